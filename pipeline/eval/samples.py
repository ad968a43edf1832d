"""The `samples` suite: greedy answers of the model (and the base) to a few fixed prompts.

What a user wants to see first is what the model says. Design choices:
* Greedy decoding (`do_sample=False`), so an answer is a property of the checkpoint, not of a seed; the
  prompt is rendered with the tokenizer's chat template when it has one (instruct models), as a user
  would chat with it, and the answer is what comes after the prompt, special tokens dropped.
* Printed as it comes out: no filtering, no retry. Honest beats pretty.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hylo.pipeline.eval.decode import eos_ids


def _prompt_ids(tokenizer, prompt: str, chat_template: bool) -> list[int]:
    if chat_template and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(prompt)["input_ids"]]


@torch.no_grad()
def greedy_answers(model: nn.Module, tokenizer, prompts: list[str], max_new_tokens: int,
                   chat_template: bool = True) -> list[dict[str, Any]]:
    """[{prompt, answer, new_tokens}] of `model`'s greedy continuation of each prompt."""
    device = next(model.parameters()).device
    eos = eos_ids(model, tokenizer)
    out = []
    for prompt in prompts:
        ids = torch.tensor([_prompt_ids(tokenizer, prompt, chat_template)], device=device)
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=eos or None,
                             pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else
                             (eos[0] if eos else 0))
        new = gen[0, ids.shape[1]:].tolist()
        out.append({"prompt": prompt, "answer": tokenizer.decode(new, skip_special_tokens=True).strip(),
                    "new_tokens": len(new)})
    return out
