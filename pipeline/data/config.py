"""Data-preparation config: mixture -> tokenize -> pack -> shards, loaded through `hylo.pipeline.config`.

Every config class and choice of the data jobs lives here, the decontamination job's included: a leaf that
imports no implementation (readers, mixture, packing, render and decontam import it). A source is a
`SourceSpec` (where and how to read) plus its mixture `weight`. Defaults are the stage-2 shape (65,536-token
rows); stage 1 sets `split: stage1` and `packing.max_len: 2048`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hylo.pipeline.config import (
    FILE_NAME,
    NONEMPTY,
    NONEMPTY_PATH,
    OUTPUT_PATH,
    PATH,
    ROW_TOKENS,
    SEED,
    FieldError,
    RayInitSection,
    at_least,
    between,
    one_of,
    rules,
)

# ------------------------------------------------------------------ choices the implementations share
# Which records a dataset holds (mixture.py) and what stage 2 reads.
SPLITS = ("stage1", "stage2", "all")
STAGE2_MODES = ("all", "rest")
# What packing.py does with a document longer than a row.
LONG_DOC_POLICIES = ("split", "truncate", "drop")
# How render.py finds the assistant tokens that carry the loss.
MASK_METHODS = ("auto", "generation", "prefix", "final", "prefix_or_final")
# Decontamination (decontam/): what happens to a matched record, how results are written, which scanner.
MODES = ("drop", "cut")
OUTPUT_FORMATS = ("jsonl", "parquet")
SCANNERS = ("ray", "local", "reference")
# Readers (readers/): record schemas and file containers.
SCHEMAS = ("auto", "sharegpt", "messages", "prompt_response")
CONTAINERS = ("auto", "json", "jsonl", "parquet", "hf_disk", "hub")


class SourceError(ValueError):
    """A source cannot be opened at all (missing path, bad option, missing package); names the source."""


# ------------------------------------------------------------------------------ sources (readers/)
@dataclass
@rules(name=NONEMPTY, path=NONEMPTY_PATH, limit=at_least(1))
class SourceSpec:
    """Where a source lives and how to read it. Plain fields so it nests in any `hylo.pipeline.config` tree."""

    name: str
    path: str
    schema: str = "auto"
    container: str = "auto"
    # DatasetDict split (hf_disk) or hub split.
    split: str = "train"
    # Hub dataset configuration name (e.g. "ARC-Challenge").
    subset: str | None = None
    id_field: str = "id"
    conversations_field: str = "conversations"
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    response_field: str = "response"
    system_field: str | None = "system"
    # Accept a conversation whose first non-system turn is the assistant's (ShareGPT's split
    # conversations: ~6.3K of its 17.7K continue a previous part). Off: `repair` drops those turns.
    allow_assistant_first: bool = False
    # Repair broken conversations (empty turns, leading assistant turns, same-role runs, role aliases)
    # instead of rejecting them; each repair is counted by kind. Off: such records are rejects.
    repair: bool = True
    # A system turn for records without one; `context_field` text is appended to it (blank line between).
    system_prompt: str | None = None
    context_field: str | None = None
    # The final assistant reply, for records whose conversation ends with the user (str or list of str).
    answer_field: str | None = None
    # [old, new] literal replacements applied to assistant turns, in order (e.g. reasoning markers).
    assistant_replace: list[list[str]] = field(default_factory=list)
    # A source with no usable record is an error (a wrong path, an empty download); true: a warning.
    allow_empty: bool = False
    # Stop after this many items (records + rejects) per source; None = all.
    limit: int | None = None

    def __not_paths__(self) -> set[str]:
        """A Hub dataset (container hub, or path hub:NAME) is named, not a local path."""
        return {"path"} if self.container == "hub" else set()

    def __post_init__(self) -> None:
        if self.schema not in SCHEMAS:
            raise SourceError(f"source {self.name!r}: schema {self.schema!r} not in {SCHEMAS}")
        if self.container not in CONTAINERS:
            raise SourceError(f"source {self.name!r}: container {self.container!r} not in {CONTAINERS}")
        for pair in self.assistant_replace:
            if len(pair) != 2 or not all(isinstance(x, str) for x in pair) or not pair[0]:
                raise SourceError(f"source {self.name!r}: assistant_replace entries are [old, new] strings "
                                  f"with a non-empty old, got {pair!r}")


# -------------------------------------------------------------------------- decontamination (decontam/)
@dataclass
@rules(name=FILE_NAME, path=PATH)
class BenchmarkSpec:
    """An evaluation suite to decontaminate against. `path` "" -> the built-in/registry entry."""

    name: str
    # Local JSONL/JSON/Parquet file, directory, HF save_to_disk dir, or "hub:<dataset>".
    path: str = ""
    # Fields whose text is indexed; dotted paths reach nested values ("choices.text"); a list of
    # strings gives one segment per string.
    fields: list[str] = field(default_factory=list)
    id_field: str = "id"
    split: str = "test"
    subset: str | None = None


@dataclass
@rules(ngram=at_least(2), short_min_words=at_least(1), min_content_words=at_least(0), max_item_df=at_least(1),
       boilerplate_docs=at_least(0), boilerplate_coverage=between(0, 1, lo_open=True), mode=one_of(*MODES))
class MatchConfig:
    """The matching flags; the job and the reference scan use the same ones."""

    # An item field of at least this many words is indexed by its n-grams (13: GPT-3, lm-eval).
    ngram: int = 13
    # A field of short_min_words .. ngram-1 words is indexed whole; a shorter one matches an equal turn only.
    short_min_words: int = 5
    # N-grams with fewer words that are not stopwords, single characters or numbers are never indexed.
    min_content_words: int = 2
    # N-grams shared by more items of one suite (prompt templates, licence headers) are dropped.
    max_item_df: int = 5
    # An n-gram in at least this many records is a common phrase, and a record matched only through
    # such phrases is kept (listed in the report); 0 disables the mixture-frequency rule.
    boilerplate_docs: int = 50
    # A record holding at least this share of an item's n-grams is a leak of it, whatever the phrases.
    boilerplate_coverage: float = 0.5
    # drop: remove the matched record; cut: remove only the matched spans (a record it empties is dropped).
    mode: str = "drop"

    def __post_init__(self) -> None:
        if self.short_min_words > self.ngram:
            raise ValueError(f"match.short_min_words must be in [1, ngram={self.ngram}], "
                             f"got {self.short_min_words}")


@dataclass
@rules(output_format=one_of(*OUTPUT_FORMATS), scanner=one_of(*SCANNERS), batch_size=at_least(1), out=OUTPUT_PATH)
class DecontamJobConfig:
    inputs: list[SourceSpec] = field(default_factory=list)
    benchmarks: list[BenchmarkSpec] = field(default_factory=lambda: [BenchmarkSpec("humaneval")])
    match: MatchConfig = field(default_factory=MatchConfig)
    out: str = "runs/decontam"
    output_format: str = "jsonl"
    # Turns (records) per scan batch.
    batch_size: int = 256
    # ray: Ray Data tasks; local: the same fast scan in-process; reference: plain Python n-gram sets.
    scanner: str = "ray"
    # The job's Ray (pipeline/ray_init.py): a local one of 2 CPUs unless an address or $RAY_ADDRESS is given.
    ray: RayInitSection = field(default_factory=lambda: RayInitSection(num_cpus=2))
    progress: bool = True

    def __post_init__(self) -> None:
        names = [s.name for s in self.inputs]
        if len(set(names)) != len(names):
            raise ValueError(f"inputs: duplicate source names {names}")
        suites = [b.name for b in self.benchmarks]
        if len(set(suites)) != len(suites):
            raise ValueError(f"benchmarks: duplicate suite names {suites}")


# -------------------------------------------------------------------------- the data-preparation job
def _refuse_duplicates(names: list[str], what: str) -> None:
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{what} {dup}")


@dataclass
@rules(weight=at_least(0))
class MixtureSource(SourceSpec):
    # Sampling proportion: 2.0 repeats each record, 0.5 keeps about half.
    weight: float = 1.0


@dataclass
@rules(seed=SEED, stage1_fraction=between(0, 1), stage2=one_of(*STAGE2_MODES))
class MixtureConfig:
    sources: list[MixtureSource] = field(default_factory=list)
    seed: int = 0
    # Fraction of records (by id hash) that belong to stage 1 (the published recipe: 20 %).
    stage1_fraction: float = 0.2
    # What stage 2 reads: "all" = the whole mixture (the published recipe), "rest" = the records not
    # in stage 1 (disjoint stages).
    stage2: str = "all"
    # Changing the salt re-draws the split; keep it fixed across the stage-1 and stage-2 runs.
    split_salt: str = "hylo-split-v1"

    def __post_init__(self) -> None:
        _refuse_duplicates([s.name for s in self.sources], "mixture.sources: duplicate source name(s)")


@dataclass
@rules(mask_method=one_of(*MASK_METHODS), num_actors=at_least(1), batch_size=at_least(1), tokenizer=PATH)
class TokenizeConfig:
    # A directory with a fast tokenizer + chat template, or an asset name (hylo.assets).
    tokenizer: str = "smollm2-135m-instruct"
    # auto | generation | prefix | final | prefix_or_final (pipeline/data/render.py).
    mask_method: str = "auto"
    # Extra chat-template variables. Llama 3.x needs `date_string`, or its template writes today's
    # date into every system header (other tokens every day).
    chat_template_kwargs: dict[str, str] = field(default_factory=dict)
    # Ray Data actor pool size and records per map_batches call.
    num_actors: int = 2
    batch_size: int = 64


@dataclass
@rules(max_len=ROW_TOKENS, window=at_least(1), max_open_rows=at_least(1), close_slack=at_least(0),
       long_doc_policy=one_of(*LONG_DOC_POLICIES), pad_id=at_least(0), min_loss_tokens=at_least(0))
class PackingConfig:
    # Tokens per packed row: the rows' one length. The manifest records it as max_len; training takes it
    # from there (its data.seq_len is only an optional check).
    max_len: int = 65536
    # Documents buffered per best-fit-decreasing round.
    window: int = 1024
    max_open_rows: int = 64
    # A row with at most this many free tokens closes at once.
    close_slack: int = 0
    long_doc_policy: str = "split"
    pad_to_max_len: bool = True
    # None: the tokenizer's pad token, else its EOS token.
    pad_id: int | None = None
    # Drop pieces (documents, windows of split ones) with fewer loss (assistant-label) tokens; counted in
    # the report. 1 for stage 2, whose KL is on assistant tokens only; 0 (keep all) for stage 1's ILD.
    min_loss_tokens: int = 0

    def __post_init__(self) -> None:
        if self.close_slack >= self.max_len:
            raise FieldError("close_slack", self.close_slack, f"must be < max_len ({self.max_len})")


@dataclass
@rules(scanner=one_of("ray", "local"), batch_size=at_least(1))
class DecontamSection:
    """Evaluation items removed from the mixture before packing (pipeline/data/decontam/).

    The decision is made on the whole mixture (every source, every split), so stage 1 and stage 2
    remove the same records; what is removed goes to `removed.jsonl` with the matched item.
    """

    # Empty: no decontamination. A known suite (decontam.SUITES) with a local `path` takes the
    # registry's fields; any other needs `fields` too.
    benchmarks: list[BenchmarkSpec] = field(default_factory=list)
    match: MatchConfig = field(default_factory=MatchConfig)
    # ray: Ray Data tasks on the job's Ray; local: in the driver.
    scanner: str = "ray"
    batch_size: int = 256

    def __post_init__(self) -> None:
        _refuse_duplicates([b.name for b in self.benchmarks], "decontam.benchmarks: duplicate suite name(s)")


@dataclass
@rules(rows_per_shard=at_least(1), row_group_rows=at_least(0), dir=OUTPUT_PATH)
class OutputConfig:
    dir: str = "runs/data/stage2"
    rows_per_shard: int = 64
    # Rows per Parquet row group (the reader's read granularity); 0 = about 1 M tokens per group.
    row_group_rows: int = 0
    # Replace an existing dataset in `dir`. The new one is built beside it and swapped in only when
    # complete, so a failed run (a typo in a path, a crash) leaves the old one as it was.
    overwrite: bool = False


@dataclass
@rules(split=one_of(*SPLITS))
class PrepareDataConfig:
    split: str = "stage2"
    mixture: MixtureConfig = field(default_factory=MixtureConfig)
    tokenize: TokenizeConfig = field(default_factory=TokenizeConfig)
    packing: PackingConfig = field(default_factory=PackingConfig)
    decontam: DecontamSection = field(default_factory=DecontamSection)
    output: OutputConfig = field(default_factory=OutputConfig)
    # The job's Ray (pipeline/ray_init.py): a local one of 2 CPUs unless an address or $RAY_ADDRESS is given.
    ray: RayInitSection = field(default_factory=lambda: RayInitSection(num_cpus=2))
    progress: bool = True


# Keys (dotted) that do not change the produced rows: the manifest's `config_hash`
# (hylo.pipeline.data.prepare.rows_config_hash) covers every other key, so a new one is hashed unless listed
# here. (decontam.scanner and decontam.batch_size do not change the rows either, but have always been
# hashed: leaving them out now would change the fingerprint of every dataset prepared so far.)
UNHASHED_KEYS = ("ray", "progress", "output", "tokenize.num_actors", "tokenize.batch_size")
