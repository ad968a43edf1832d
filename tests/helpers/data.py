"""Small offline stand-ins for the data recipe's inputs: tokenizers with Llama-3-like and Qwen3-like
chat templates, and files laid out like the public SFT sets and the evaluation suites.

Test modules import it as `from tests.helpers.data import ...`. The
templates are written here to reproduce the behaviour that matters to the data pipeline (Llama 3: a
system header with a date read from the clock unless `date_string` is given; Qwen3: history turns
rendered without the `<think>` block that the final reply gets), not copied from the models.
Layouts follow the public dataset cards:

* sftdatasetv3 (JunxiongWang/sftdatasetv3): JSON lines, OpenAI-style `messages`
* OpenMathInstruct-2: Parquet, `problem` / `generated_solution` / `expected_answer` / `problem_source`
* OpenThoughts-114k: Parquet, `system` + ShareGPT `conversations` [{from, value}], reasoning between
  `<|begin_of_thought|>` / `<|end_of_thought|>`, answer between `<|begin_of_solution|>` / `<|end_of_solution|>`
* OpenR1-Math-220k: Parquet, `problem` / `solution` / `answer` / `uuid` / `messages` (reasoning in `<think>`)
  / `generations` / `correctness_math_verify`
* ChatQA2-Long-SFT (long_sft): a JSON array of {`messages` (ending with the user), `document`, `answers`}
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if not date_string is defined %}{%- if strftime_now is defined %}"
    "{%- set date_string = strftime_now('%d %b %Y') %}{%- else %}{%- set date_string = '1 Jan 2000' %}"
    "{%- endif %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nToday Date: ' + date_string + '\\n\\n' }}"
    "{{- system_message + '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

QWEN3_TEMPLATE = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' %}"
    "{%- set content = m['content'] %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query and loop.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_FAMILIES: dict[str, dict[str, Any]] = {
    "llama3": {"template": LLAMA3_TEMPLATE, "bos": "<|begin_of_text|>", "eos": "<|eot_id|>", "pad": None,
               "specials": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]},
    "qwen3": {"template": QWEN3_TEMPLATE, "bos": None, "eos": "<|im_end|>", "pad": "<|endoftext|>",
              "specials": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]},
}


def save_tiny_chat_tokenizer(out_dir: str | Path, family: str) -> Path:
    """A byte-level tokenizer (one token per byte, the family's special tokens) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    fam = _FAMILIES[family]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(fam["specials"])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=fam["bos"], eos_token=fam["eos"],
                                  pad_token=fam["pad"])
    tok.chat_template = fam["template"]
    out = Path(out_dir)
    tok.save_pretrained(out)
    return out


# ------------------------------------------------------------------------ public SFT set layouts
def _words(rng: random.Random, n: int) -> str:
    vocab = ("alpha beta gamma delta number prime sum product angle circle triangle river story "
             "chapter answer question reason value count length area city year name total").split()
    return " ".join(rng.choice(vocab) for _ in range(n))


def _write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=16)
    return path


def write_public_sft_samples(root: str | Path, n: int = 40, seed: int = 0, leaks: dict[str, str] | None = None,
                             sizes: dict[str, int] | None = None) -> dict[str, Path]:
    """Small files with the public sets' schemas under `root/datasets/...` (the configs' layout).

    `n` records per set (`sizes` overrides per source name). `leaks` maps a source name
    (sftdatasetv3 or openmathinstruct2) to a text planted in every 7th record (a benchmark item, to
    check that decontamination finds it). Returns the file of each source.
    """
    rng = random.Random(seed)
    root = Path(root) / "datasets"
    leaks = leaks or {}
    size = {name: (sizes or {}).get(name, n) for name in
            ("sftdatasetv3", "openmathinstruct2", "openthoughts", "openr1_math", "chatqa2_long_sft")}
    out: dict[str, Path] = {}

    sft = []
    for i in range(size["sftdatasetv3"]):
        msgs = [{"role": "system", "content": "You are helpful."}] if i % 5 == 0 else []
        for t in range(1 + i % 3):
            msgs += [{"role": "user", "content": f"q{i}.{t} " + _words(rng, 8 + i % 7)},
                     {"role": "assistant", "content": f"a{i}.{t} " + _words(rng, 10 + i % 11)}]
        if i % 7 == 0 and "sftdatasetv3" in leaks:
            msgs[-2]["content"] = leaks["sftdatasetv3"]
        sft.append({"messages": msgs})
    p = root / "sftdatasetv3" / "train.jsonl"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("".join(json.dumps(r) + "\n" for r in sft))
    out["sftdatasetv3"] = p

    omi = [{"problem": leaks["openmathinstruct2"] if i % 7 == 0 and "openmathinstruct2" in leaks
            else f"Problem {i}: " + _words(rng, 12),
            "generated_solution": "Let us compute. " + _words(rng, 20) + f" The answer is \\boxed{{{i}}}.",
            "expected_answer": str(i), "problem_source": "augmented_math"} for i in range(size["openmathinstruct2"])]
    out["openmathinstruct2"] = _write_parquet(root / "OpenMathInstruct-2" / "data" / "train_1M-00000-of-00001.parquet",
                                              omi)

    system = "Your role as an assistant involves thoroughly exploring questions through a long thinking process."
    ot = [{"system": system, "conversations": [
        {"from": "user", "value": f"Return your final response within \\boxed{{}}. Task {i}: " + _words(rng, 10)},
        {"from": "assistant", "value": "<|begin_of_thought|>\n\n" + _words(rng, 25) + "\n\n<|end_of_thought|>\n\n"
                                       "<|begin_of_solution|>\n\n" + _words(rng, 8) + f" \\boxed{{{i}}}\n\n"
                                       "<|end_of_solution|>"}]} for i in range(size["openthoughts"])]
    out["openthoughts"] = _write_parquet(root / "OpenThoughts-114k" / "data" / "train-00000-of-00001.parquet", ot)

    r1 = []
    for i in range(size["openr1_math"]):
        prob = f"Math {i}: " + _words(rng, 11)
        gen = "<think>\n" + _words(rng, 30) + "\n</think>\n\n" + _words(rng, 6) + f" \\boxed{{{i}}}"
        r1.append({"problem": prob, "solution": _words(rng, 15), "answer": str(i), "problem_type": "Algebra",
                   "question_type": "math-word-problem", "source": "olympiads", "uuid": f"uuid-{seed}-{i:04d}",
                   "is_reasoning_complete": [True, True], "generations": [gen, gen + " again"],
                   "correctness_math_verify": [True, False], "correctness_count": 1,
                   "messages": [{"role": "user", "content": prob}, {"role": "assistant", "content": gen}]})
    out["openr1_math"] = _write_parquet(root / "OpenR1-Math-220k" / "data" / "train-00000-of-00001.parquet", r1)

    cq = []
    for i in range(size["chatqa2_long_sft"]):
        turns = [{"role": "user", "content": f"According to the text, what about item {i}?"}]
        if i % 3 == 1:
            turns = [{"role": "user", "content": f"Summarise part {i}."},
                     {"role": "assistant", "content": _words(rng, 9)}] + turns
        cq.append({"messages": turns, "document": f"Document {i}. " + _words(rng, 60 + 7 * (i % 9)),
                   "answers": [f"Item {i} is " + _words(rng, 5)]})
    p = root / "ChatQA2-Long-SFT-data" / "long_sft" / "long_sft_QA_train.json"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(cq, indent=1))
    out["chatqa2_long_sft"] = p
    return out


# Items per evaluation suite, with the registry's fields (decontam.SUITES) and each suite's own ids.
def _suite_rows(rng: random.Random, name: str, n: int) -> list[dict[str, Any]]:
    rows = []
    for i in range(n):
        q = f"{name} item {i}: " + _words(rng, 16)
        opts = [_words(rng, 4) for _ in range(4)]
        rows.append({
            "arc_easy": {"id": f"ARCE-{i}", "question": q, "choices": {"text": opts, "label": list("ABCD")},
                         "answerKey": "A"},
            "arc_challenge": {"id": f"ARCC-{i}", "question": q, "choices": {"text": opts, "label": list("ABCD")},
                              "answerKey": "B"},
            "hellaswag": {"ind": i, "ctx": q, "endings": opts, "label": "0"},
            "openbookqa": {"id": f"OBQA-{i}", "question_stem": q, "choices": {"text": opts, "label": list("ABCD")}},
            "piqa": {"goal": q, "sol1": opts[0] + " " + _words(rng, 6), "sol2": opts[1] + " " + _words(rng, 6),
                     "label": 0},
            "race": {"example_id": f"race-{i}", "article": q + " " + _words(rng, 40), "question": "Why?",
                     "options": opts, "answer": "A"},
            "winogrande": {"sentence": q + " _ " + _words(rng, 5), "option1": "the river", "option2": "the city",
                           "answer": "1"},
            "gsm8k": {"question": q, "answer": _words(rng, 12) + f" #### {i}"},
            "mmlu": {"question": q, "subject": "algebra", "choices": opts, "answer": 0},
        }[name])
    return rows


EVAL_SUITES = ("arc_easy", "arc_challenge", "hellaswag", "openbookqa", "piqa", "race", "winogrande", "gsm8k", "mmlu")


def write_eval_suites(root: str | Path, n: int = 6, seed: int = 1) -> dict[str, list[dict[str, Any]]]:
    """`root/evals/<suite>.jsonl` for every evaluation suite of the recipes (RULER has no fixed items)."""
    rng = random.Random(seed)
    d = Path(root) / "evals"
    d.mkdir(parents=True, exist_ok=True)
    out = {}
    for name in EVAL_SUITES:
        rows = _suite_rows(rng, name, n)
        (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        out[name] = rows
    return out
