"""Decontamination: find and remove mixture records that contain evaluation-benchmark items.

Pipeline (`run_decontamination`): read the inputs with `readers` (bad records -> rejects.jsonl) ->
build one n-gram index over every benchmark item -> scan every turn of every record (Ray Data
`map_batches` tasks; the index travels once through the object store and each worker process
builds its scanner once) -> decide per record ->
write clean records, removed records (with the matched suite, item id and n-gram) and a JSON +
Markdown report per suite.

Matching (all on `normalize.normalize_words`: NFKC, lowercase, punctuation/whitespace folded):
* an item field of >= n words is indexed by its n-grams (n = 13 by default, GPT-3 / lm-eval);
* a field of `short_min_words` .. n-1 words is indexed whole, as one shorter n-gram;
* a field shorter than that matches only a turn that is exactly that field (after normalisation).
A record matches an item when one of its turns contains one of the item's indexed n-grams.

Boilerplate, the usual source of false positives, is handled three ways:
1. low-content n-grams (fewer than `min_content_words` words that are not stopwords, single
   characters or numbers) are never indexed;
2. template n-grams that occur in more than `max_item_df` items of one suite (shared prompt text,
   licence headers) are dropped from the index;
3. mixture-frequent n-grams: a record that contains at least `boilerplate_coverage` of an item's
   n-grams is a leak of that item, always. Otherwise an n-gram found in >= `boilerplate_docs`
   records (counting only records that are not such leaks, so a leak duplicated many times never
   makes its own n-grams look common) is a common phrase, and a record that matches an item only
   through such phrases is kept. Every n-gram ignored this way is listed in the report with its
   count, so a human can check the call; `boilerplate_docs: 0` turns the rule off.

Speed (FastScanner): a whole batch of turns is folded into one byte array (normalize.fold_many),
words are hashed in numpy, words outside the benchmark vocabulary (which can never match) get id
0, every window's polynomial hash comes from prefix sums (uint64, wrapping), windows pass a bitmap
prefilter and a searchsorted lookup, and every hit is verified word by word, so the result equals
the plain Python n-gram-set reference (`ReferenceScanner`, kept beside it and tested against it)
exactly. Its cost barely grows with the number of n-gram lengths (short items), the reference's
grows linearly.

Modules, one idea each: `benchmarks` (the suite registry SUITES, items), `index` (BenchmarkIndex),
`fast` (FastScanner) beside `reference` (ReferenceScanner, what the fast one must equal), `scan` (the
Ray / in-driver scan of a mixture), `decide` (hits -> contaminated records), `cut`, `report`, `job`
(`run_decontamination`). The configs (BenchmarkSpec, MatchConfig, DecontamJobConfig) live in
pipeline/data/config.py; this package re-exports them, so `hylo.pipeline.data.decontam.X` keeps working.

Limits: records are held in driver memory between read and write (a few GB per million
conversations); the scan, the expensive part, is what Ray distributes.
"""

from __future__ import annotations

from hylo.pipeline.data.config import BenchmarkSpec, DecontamJobConfig, MatchConfig, SourceError
from hylo.pipeline.data.decontam.benchmarks import (
    SUITES,
    Item,
    export_benchmarks,
    load_benchmark,
    resolve_benchmark,
)
from hylo.pipeline.data.decontam.cut import cut_record
from hylo.pipeline.data.decontam.decide import Decision, Match, decide
from hylo.pipeline.data.decontam.fast import FastScanner
from hylo.pipeline.data.decontam.index import BenchmarkIndex, Entry, Hits, build_index
from hylo.pipeline.data.decontam.job import read_jsonl, run_decontamination
from hylo.pipeline.data.decontam.reference import ReferenceScanner, reference_scan
from hylo.pipeline.data.decontam.scan import scan_and_decide, scan_mixture

__all__ = [
    "SUITES", "BenchmarkIndex", "BenchmarkSpec", "DecontamJobConfig", "Decision", "Entry", "FastScanner", "Hits",
    "Item", "Match", "MatchConfig", "ReferenceScanner", "SourceError", "build_index", "cut_record", "decide",
    "export_benchmarks", "load_benchmark", "read_jsonl", "reference_scan", "resolve_benchmark", "run_decontamination",
    "scan_and_decide", "scan_mixture",
]
