"""Needle-in-a-haystack retrieval (RULER-style), generated locally and deterministically.

Design choices:
* No dataset download: the haystack is made of short synthetic sentences drawn from small word
  lists, so the same seed gives the same prompts on any machine and with any tokenizer.
* Needles state "The secret code for <key> is <number>." with 6-digit numbers; the question asks
  for one key. Tasks: `niah_single` (one needle) and `niah_multikey` (the asked needle among
  distractor needles with other keys and numbers).
* A prompt is sized in tokens of the model's own tokenizer: sentences are added until the whole
  prompt (template, needles, question included) reaches the target length; the actual length is
  recorded. The asked needle's depth is spread evenly over the samples of a length.
* Greedy decoding through `hylo.pipeline.eval.decode.greedy_decode`; a sample is correct when the
  expected number appears in the completion (RULER's string match).
* Prompt format "chat" uses the tokenizer's chat template with a generation prompt; "plain" ends
  the prompt with "The secret code for <key> is" for a base model to complete; "auto" picks chat
  when the tokenizer has a template.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from hylo.pipeline.eval.decode import EvalError, eos_ids, greedy_decode
from hylo.pipeline.eval.progress import progress

TASKS = ("niah_single", "niah_multikey")
PROMPT_FORMATS = ("auto", "chat", "plain")

_SUBJECTS = ["the farmer", "a small boat", "the old clock", "my neighbour", "the river", "a quiet town",
             "the teacher", "our garden", "the library", "a tall tree", "the market", "the kitten"]
_VERBS = ["waited near", "looked at", "moved past", "rested beside", "stood behind", "walked toward",
          "drifted over", "leaned on", "turned from", "ran along"]
_OBJECTS = ["the bridge", "a wooden fence", "the station", "the bright window", "a green field",
            "the stone wall", "the harbour", "a narrow road", "the hill", "the painted door"]
_TAILS = ["in the morning", "after the rain", "before dinner", "on a cold day", "for a while",
          "without a sound", "as usual", "at noon", "in the evening", "once again"]
KEYS = ["amber", "birch", "cobalt", "delta", "ember", "falcon", "garnet", "harbor", "indigo", "juniper",
        "kestrel", "lotus", "maple", "nectar", "onyx", "pebble", "quartz", "raven", "saffron", "tundra"]


def filler_sentence(rng: random.Random) -> str:
    return f"{rng.choice(_SUBJECTS).capitalize()} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}."


def needle(key: str, value: str) -> str:
    return f"The secret code for {key} is {value}."


@dataclass
class Sample:
    task: str
    target_tokens: int
    depth: float
    key: str
    value: str
    input_ids: list[int]
    needles: list[tuple[str, str]] = field(default_factory=list)


class PromptBuilder:
    """Builds prompts of a target token length with one tokenizer (token counts cached per sentence)."""

    def __init__(self, tokenizer: Any, prompt_format: str = "auto") -> None:
        if prompt_format not in PROMPT_FORMATS:
            raise EvalError(f"retrieval.prompt_format {prompt_format!r}; allowed: {', '.join(PROMPT_FORMATS)}")
        has_template = bool(getattr(tokenizer, "chat_template", None))
        if prompt_format == "chat" and not has_template:
            raise EvalError("retrieval.prompt_format 'chat' but the tokenizer has no chat template")
        self.chat = prompt_format == "chat" or (prompt_format == "auto" and has_template)
        self.tok = tokenizer
        self._len: dict[str, int] = {}

    def n_tokens(self, text: str) -> int:
        if text not in self._len:
            self._len[text] = len(self.tok(" " + text, add_special_tokens=False)["input_ids"])
        return self._len[text]

    def render(self, context: str, key: str) -> list[int]:
        question = f"What is the secret code for {key}?"
        if self.chat:
            msgs = [{"role": "user", "content": f"{context}\n\n{question} Answer with the number only."}]
            ids = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return list(ids)
        text = f"{context}\n\n{question} The secret code for {key} is"
        return list(self.tok(text, add_special_tokens=True)["input_ids"])

    def build(self, task: str, target_tokens: int, depth: float, rng: random.Random, n_needles: int) -> Sample:
        keys = rng.sample(KEYS, n_needles)
        values = [str(rng.randrange(100_000, 1_000_000)) for _ in keys]
        needles = list(zip(keys, values))
        key, value = needles[0]
        overhead = len(self.render(" ".join(needle(k, v) for k, v in needles), key))
        budget = target_tokens - overhead
        sentences: list[str] = []
        used = 0
        while True:
            s = filler_sentence(rng)
            c = self.n_tokens(s)
            if used + c > budget:
                break
            sentences.append(s)
            used += c
        # the asked needle at `depth`; distractors at random places
        sentences.insert(round(depth * len(sentences)), needle(key, value))
        for k, v in needles[1:]:
            sentences.insert(rng.randrange(len(sentences) + 1), needle(k, v))
        ids = self.render(" ".join(sentences), key)
        return Sample(task, target_tokens, depth, key, value, ids, needles)


def make_samples(tokenizer: Any, lengths: list[int], samples_per_length: int, tasks: list[str],
                 seed: int = 0, prompt_format: str = "auto", multikey_needles: int = 4) -> list[Sample]:
    """Deterministic samples: the same (seed, task, length, index) always gives the same prompt."""
    bad = [t for t in tasks if t not in TASKS]
    if bad:
        raise EvalError(f"retrieval.tasks: unknown {bad}; allowed: {', '.join(TASKS)}")
    if samples_per_length < 1:
        raise EvalError(f"retrieval.samples_per_length must be >= 1, got {samples_per_length}")
    builder = PromptBuilder(tokenizer, prompt_format)
    out = []
    for task in tasks:
        for length in lengths:
            if length < 64:
                raise EvalError(f"retrieval.lengths: {length} is too short for a prompt (minimum 64 tokens)")
            for i in range(samples_per_length):
                rng = random.Random(f"{seed}/{task}/{length}/{i}")
                depth = (i + 0.5) / samples_per_length
                n = 1 if task == "niah_single" else multikey_needles
                out.append(builder.build(task, length, depth, rng, n))
    return out


def run_retrieval(model: nn.Module, tokenizer: Any, samples: list[Sample], max_new_tokens: int = 12,
                  desc: str | None = None) -> dict[str, Any]:
    """Greedy answers for every sample; accuracy per task and length, plus every sample's record.
    `desc`: show a progress bar with this label."""
    max_pos = getattr(model.config, "max_position_embeddings", None)
    eos = eos_ids(model, tokenizer)
    records = []
    bar = progress(samples, desc=desc or "retrieval", unit="sample", disable=desc is None)
    for s in bar:
        bar.set_postfix_str(f"{s.task}@{s.target_tokens}", refresh=False)
        res = greedy_decode(model, s.input_ids, max_new_tokens, eos=eos)
        text = tokenizer.decode(res.tokens, skip_special_tokens=True)
        records.append({
            "task": s.task, "target_tokens": s.target_tokens, "tokens": len(s.input_ids),
            "depth": round(s.depth, 4), "key": s.key, "expected": s.value,
            "completion": text[:200], "correct": s.value in text,
        })
    summary: dict[str, dict[str, Any]] = {}
    for r in records:
        cell = summary.setdefault(r["task"], {}).setdefault(str(r["target_tokens"]), {"n": 0, "correct": 0, "max_tokens": 0})
        cell["n"] += 1
        cell["correct"] += int(r["correct"])
        cell["max_tokens"] = max(cell["max_tokens"], r["tokens"])
    for task_cells in summary.values():
        for cell in task_cells.values():
            cell["accuracy"] = cell["correct"] / cell["n"]
            cell["beyond_max_positions"] = bool(max_pos is not None and cell["max_tokens"] > max_pos)
    return {"accuracy": summary, "samples": records, "max_position_embeddings": max_pos}
