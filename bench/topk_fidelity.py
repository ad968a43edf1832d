"""How much of the full-vocabulary KL gradient a top-k teacher record keeps, on a real model and real text.

    python bench/topk_fidelity.py                    # ~2,048 tokens of ShareGPT, k in {8,16,32,64,128}
    python bench/topk_fidelity.py --tokens 512       # quicker

Teacher: SmolLM2-135M-Instruct's final (normed) hidden states; W = its LM head (tied embeddings).
Students (student == teacher would give a zero gradient, so a weaker one is needed):
* "layer-L": the hidden state entering layer L (default 28 of 30) passed through the final norm,
  i.e. the same model cut short: a structured gap (about 2.7 nats/token of KL at L=28);
* "noisy-a": the teacher's hidden state plus Gaussian noise of a x its per-token RMS (default 0.5
  and 0.2: about 1.5 and 0.3 nats/token, closer to a student late in distillation).
For each k: bytes per token of the stored record (fp16 log-probs + int32 ids, + fp32 tail mass), and the
cosine similarity between the top-k loss gradient w.r.t. the student hidden states and the full-vocabulary
gradient (global over all tokens, and the mean of per-token cosines), with and without the tail bucket.

Text: the first conversations of the ShareGPT file, read record by record with
json.JSONDecoder.raw_decode (the file is cut off mid-record; a broken record ends the reading and is
reported), rendered with the model's chat template, one forward per conversation (up to --max-len tokens).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from hylo.assets import fetch_asset
from hylo.kernels.fused_kl import TeacherTopK, fused_linear_kl_div, topk_from_logits

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}


def iter_sharegpt(path: Path, block_bytes: int = 1 << 20) -> Iterator[dict]:
    """Yield complete records of a JSON array, reading it in blocks; stop (and say so) at a broken tail."""
    decoder = json.JSONDecoder()
    buf = ""
    started = False
    with open(path, encoding="utf-8") as f:
        eof = False
        while True:
            if not eof:
                block = f.read(block_bytes)
                eof = block == ""
                buf += block
            pos = 0
            if not started:
                pos = buf.find("[")
                if pos < 0:
                    if eof:
                        raise ValueError(f"{path}: not a JSON array")
                    continue
                pos += 1
                started = True
            while True:
                while pos < len(buf) and buf[pos] in " \t\r\n,":
                    pos += 1
                if pos < len(buf) and buf[pos] == "]":
                    return
                try:
                    record, end = decoder.raw_decode(buf, pos)
                except json.JSONDecodeError:
                    break
                yield record
                pos = end
            buf = buf[pos:]
            if eof:
                if buf.strip():
                    print(f"note: {path} ends inside a record ({len(buf)} chars not parsed); reading stopped there")
                return


def conversations_to_ids(tokenizer, path: Path, n_tokens: int, max_len: int) -> list[torch.Tensor]:
    docs, total, skipped = [], 0, 0
    for record in iter_sharegpt(path):
        messages = [
            {"role": ROLES[t.get("from")], "content": t.get("value", "")}
            for t in record.get("conversations", [])
            if t.get("from") in ROLES and t.get("value")
        ]
        if len(messages) < 2:
            skipped += 1
            continue
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        ids = torch.tensor(ids[: min(max_len, n_tokens - total)], dtype=torch.long)
        if ids.numel() < 16:
            continue
        docs.append(ids)
        total += ids.numel()
        if total >= n_tokens:
            break
    print(f"text: {len(docs)} ShareGPT conversations, {total} tokens ({skipped} empty/one-turn records skipped)")
    return docs


@torch.no_grad()
def topk_record(teacher_hidden: torch.Tensor, weight: torch.Tensor, k: int, chunk: int = 512) -> TeacherTopK:
    parts = [topk_from_logits(teacher_hidden[i : i + chunk] @ weight.t(), k) for i in range(0, len(teacher_hidden), chunk)]
    return TeacherTopK(*(torch.cat(p) for p in zip(*parts)))


def grad_wrt_student(student: torch.Tensor, weight: torch.Tensor, **teacher) -> tuple[torch.Tensor, float]:
    h = student.detach().clone().requires_grad_()
    loss = fused_linear_kl_div(h, weight, **teacher)
    (g,) = torch.autograd.grad(loss, [h])
    return g, float(loss.detach())


def cosines(g: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    global_cos = float(F.cosine_similarity(g.flatten(), ref.flatten(), dim=0))
    per_token = F.cosine_similarity(g, ref, dim=1)
    return global_cos, float(per_token.mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--ks", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    parser.add_argument("--student-layers", type=int, nargs="*", default=[28])
    parser.add_argument("--noise", type=float, nargs="*", default=[0.5, 0.2])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    model_dir = fetch_asset("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    docs = conversations_to_ids(tokenizer, fetch_asset("sharegpt"), args.tokens, args.max_len)

    start = time.perf_counter()
    teacher_parts, layer_parts = [], {layer: [] for layer in args.student_layers}
    with torch.no_grad():
        for ids in docs:
            out = model(ids[None], output_hidden_states=True)
            # hidden_states[-1] is already after the final norm; [L] is the input of layer L.
            teacher_parts.append(out.hidden_states[-1][0])
            for layer, parts in layer_parts.items():
                parts.append(model.model.norm(out.hidden_states[layer])[0])
    teacher = torch.cat(teacher_parts)
    weight = model.lm_head.weight.detach()
    rms = teacher.pow(2).mean(-1, keepdim=True).sqrt()
    students = {f"layer-{layer}": torch.cat(parts) for layer, parts in layer_parts.items()}
    for a in args.noise:
        students[f"noisy-{a:g}"] = teacher + a * rms * torch.randn_like(teacher)
    print(f"model forward: {time.perf_counter() - start:.1f} s for {teacher.shape[0]} tokens; V={weight.shape[0]}, H={weight.shape[1]}")

    records = {k: topk_record(teacher, weight, k) for k in args.ks}
    header = (
        f"{'student':<10} {'k':>4} {'B/tok tail':>10} {'B/tok no-tail':>13} {'cos tail':>9} {'cos no-tail':>11} "
        f"{'tok-cos tail':>12} {'tok-cos no-tail':>15} {'loss tail':>9} {'loss no-tail':>12}"
    )
    for name, student in students.items():
        g_full, loss_full = grad_wrt_student(student, weight, teacher_hidden=teacher, teacher_weight=weight)
        print(f"\nstudent {name}: full-vocabulary KL {loss_full:.4f} nats/token")
        print(header)
        print("-" * len(header))
        for k, rec in records.items():
            no_tail = TeacherTopK(rec.logprobs, rec.indices)
            g_tail, loss_tail = grad_wrt_student(student, weight, teacher_topk=rec)
            g_no, loss_no = grad_wrt_student(student, weight, teacher_topk=no_tail)
            cos_t, tok_t = cosines(g_tail, g_full)
            cos_n, tok_n = cosines(g_no, g_full)
            print(
                f"{name:<10} {k:>4} {rec.bytes_per_token():>10.0f} {no_tail.bytes_per_token():>13.0f} "
                f"{cos_t:>9.4f} {cos_n:>11.4f} {tok_t:>12.4f} {tok_n:>15.4f} {loss_tail:>9.4f} {loss_no:>12.4f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
