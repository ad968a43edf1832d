"""lm-evaluation-harness model class `hylo` for HyLo (and HF) checkpoints.

    from pipeline.eval.lm_eval_adapter import register
    register()                      # imports lm_eval; `--model hylo` / simple_evaluate(model="hylo")
    lm_eval.simple_evaluate(model="hylo", model_args="pretrained=runs/hylo,dtype=bfloat16",
                            tasks=["arc_easy", "hellaswag"], num_fewshot=0)

Design choices:
* Importing this module does not import lm_eval: the scoring logic lives in `Scorer`, which takes
  plain strings and works without the harness; `register()` builds the `lm_eval.api.model.LM`
  subclass around it and registers it under "hylo" (idempotent).
* loglikelihood: trailing spaces of the context move into the continuation (the harness's
  convention), the pair is tokenised together and split at the context's token count; an empty
  context is replaced by the prefix token (BOS, else EOS). Too-long inputs lose tokens on the left.
* HyLo models score many requests in one forward: sequences are packed into rows of at most
  `max_batch_tokens` tokens with `cu_seqlens` (documents isolated exactly as in training). HF
  models run one sequence per forward (no padding, so no attention-mask subtleties).
* Only the continuation's logits are computed (hidden states of those positions times lm_head),
  in fp32.
* loglikelihood_rolling: disjoint prediction windows of `max_length` tokens, each conditioned on
  as much preceding text as fits, the first on the prefix token: every token is predicted once.
* generate_until: greedy, with the model's cache, stopping at EOS, at `max_gen_toks`, or as soon
  as one of the `until` strings appears in the decoded text (which is cut there).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pipeline.eval.decode import EvalError, eos_ids, greedy_decode, is_hylo, load_model, load_tokenizer

MODEL_NAME = "hylo"


class Scorer:
    """Log-likelihoods and greedy generations of one causal LM on strings."""

    def __init__(self, model: nn.Module, tokenizer: Any, max_length: int | None = None,
                 max_batch_tokens: int = 8192) -> None:
        if tokenizer is None:
            raise EvalError("the lm-eval adapter needs a tokenizer (none found beside the model)")
        self.model = model
        self.tok = tokenizer
        self.max_length = int(max_length or getattr(model.config, "max_position_embeddings", 2048))
        self.max_batch_tokens = max(max_batch_tokens, self.max_length)
        self.eos = eos_ids(model, tokenizer)
        bos = getattr(tokenizer, "bos_token_id", None)
        self.prefix_token_id = int(bos) if bos is not None else (self.eos[0] if self.eos else 0)
        self.device = next(model.parameters()).device
        self.head = model.get_output_embeddings()

    # ----------------------------------------------------------------- tokens
    def encode(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        if not context:
            cont = self.encode(continuation)
            return [self.prefix_token_id], cont
        n_space = len(context) - len(context.rstrip())
        if n_space:
            context, continuation = context[:-n_space], context[-n_space:] + continuation
        whole = self.encode(context + continuation)
        n_ctx = len(self.encode(context))
        return whole[:n_ctx], whole[n_ctx:]

    # ----------------------------------------------------------------- scoring
    @torch.no_grad()
    def _continuation_logprobs(self, seqs: list[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """For (tokens, n_scored): sum log p of the last n_scored tokens, and whether greedy picks them."""
        results: list[tuple[float, bool] | None] = [None] * len(seqs)
        order = list(range(len(seqs)))
        groups: list[list[int]] = []
        if is_hylo(self.model):
            cur: list[int] = []
            used = 0
            for i in order:
                n = len(seqs[i][0]) - 1
                if cur and used + n > self.max_batch_tokens:
                    groups.append(cur)
                    cur, used = [], 0
                cur.append(i)
                used += n
            if cur:
                groups.append(cur)
        else:
            groups = [[i] for i in order]
        for group in groups:
            inputs = [seqs[i][0][:-1] for i in group]
            ids_T = torch.tensor([t for s in inputs for t in s], dtype=torch.long, device=self.device)
            lens = [len(s) for s in inputs]
            if is_hylo(self.model):
                cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=self.device)
                h_TD = self.model.model(input_ids=ids_T[None], cu_seqlens=cu if len(lens) > 1 else None).last_hidden_state[0]
            else:
                h_TD = self.model.base_model(input_ids=ids_T[None], use_cache=False).last_hidden_state[0]
            start = 0
            for i, n_in in zip(group, lens):
                tokens, n_scored = seqs[i]
                h_ND = h_TD[start + n_in - n_scored:start + n_in]
                logp_NV = torch.log_softmax(self.head(h_ND).float(), dim=-1)
                target_N = torch.tensor(tokens[-n_scored:], dtype=torch.long, device=self.device)
                lp = float(logp_NV.gather(1, target_N[:, None]).sum())
                greedy = bool((logp_NV.argmax(-1) == target_N).all())
                results[i] = (lp, greedy)
                start += n_in
        return results  # type: ignore[return-value]

    def _fit(self, ctx: list[int], cont: list[int]) -> tuple[list[int], int]:
        if not cont:
            raise EvalError("loglikelihood: the continuation encodes to no tokens")
        tokens = (ctx + cont)[-(self.max_length + 1):]
        return tokens, min(len(cont), len(tokens) - 1)

    def loglikelihood(self, pairs: Iterable[tuple[str, str]]) -> list[tuple[float, bool]]:
        seqs = [self._fit(*self.encode_pair(c, x)) for c, x in pairs]
        return self._continuation_logprobs(seqs)

    def rolling_windows(self, tokens: list[int]) -> list[tuple[list[int], int]]:
        """(window tokens, n_scored) covering every token once; window length <= max_length + 1."""
        full = [self.prefix_token_id, *tokens]
        L = self.max_length
        out = []
        for s in range(0, len(tokens), L):
            end = min(s + L, len(tokens))
            a = max(0, end - L)
            # inputs full[a:end] predict full[a+1:end+1] = tokens[a:end]; score tokens[s:end]
            out.append((full[a:end + 1], end - s))
        return out

    def loglikelihood_rolling(self, texts: Iterable[str]) -> list[float]:
        out = []
        for text in texts:
            windows = self.rolling_windows(self.encode(text))
            out.append(sum(lp for lp, _ in self._continuation_logprobs(windows)) if windows else 0.0)
        return out

    def generate_until(self, requests: Iterable[tuple[str, dict[str, Any]]], default_max_gen_toks: int = 256) -> list[str]:
        out = []
        for context, kwargs in requests:
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_gen = int(kwargs.pop("max_gen_toks", default_max_gen_toks))
            if kwargs.get("do_sample") or float(kwargs.get("temperature", 0.0) or 0.0) > 0:
                raise EvalError("generate_until: only greedy decoding is supported (do_sample=False, temperature=0)")
            ctx = self.encode(context) if context else [self.prefix_token_id]
            ctx = ctx[-max(1, self.max_length - max_gen):]

            def stop(toks: list[int], until: list[str] = until) -> bool:
                text = self.tok.decode(toks, skip_special_tokens=True)
                return any(u in text for u in until)

            res = greedy_decode(self.model, ctx, max_gen, eos=self.eos, stop=stop if until else None)
            text = self.tok.decode(res.tokens, skip_special_tokens=True)
            cut = min((text.index(u) for u in until if u in text), default=len(text))
            out.append(text[:cut])
        return out


_REGISTERED: dict[str, type] = {}


def register(name: str = MODEL_NAME) -> type:
    """Define the lm_eval `LM` subclass and register it under `name`; returns the class."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    try:
        from lm_eval.api.model import LM
        from lm_eval.api.registry import register_model
    except ImportError as e:
        raise EvalError("lm-evaluation-harness is not installed: pip install lm-eval") from e

    class HyLoLM(LM):
        """`pretrained` = HyLo or HF checkpoint directory (or asset name)."""

        def __init__(self, pretrained: str | None = None, dtype: str = "float32", device: str = "auto",
                     max_length: int | None = None, max_batch_tokens: int = 8192, tokenizer: str | None = None,
                     model: nn.Module | None = None, tokenizer_obj: Any = None, batch_size: Any = None,
                     **unused: Any) -> None:
            super().__init__()
            if model is None:
                if pretrained is None:
                    raise EvalError("model_args needs pretrained=<checkpoint dir>")
                model = load_model(pretrained, dtype=dtype, device=device)
            if tokenizer_obj is None:
                tokenizer_obj = load_tokenizer(tokenizer or pretrained)
            self.scorer = Scorer(model, tokenizer_obj, max_length=int(max_length) if max_length else None,
                                 max_batch_tokens=int(max_batch_tokens))
            self._device = self.scorer.device
            self.pretrained = pretrained

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return self.scorer.loglikelihood([r.args for r in requests])

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return self.scorer.loglikelihood_rolling([r.args[0] for r in requests])

        def generate_until(self, requests, disable_tqdm: bool = False):
            return self.scorer.generate_until([r.args for r in requests])

        @property
        def tokenizer_name(self) -> str:
            return str(getattr(self.scorer.tok, "name_or_path", "hylo")).replace("/", "__")

        def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
            return self.scorer.tok.apply_chat_template(chat_history, tokenize=False,
                                                       add_generation_prompt=add_generation_prompt)

        def chat_template(self, chat_template: bool | str = False) -> str | None:
            return getattr(self.scorer.tok, "chat_template", None) if chat_template else None

    HyLoLM.__name__ = HyLoLM.__qualname__ = "HyLoLM"
    register_model(name)(HyLoLM)
    _REGISTERED[name] = HyLoLM
    return HyLoLM


def run_lm_eval(model_dir: str, tasks: list[str], dtype: str = "float32", device: str = "auto",
                num_fewshot: int | None = 0, limit: float | None = None, include_path: str | None = None,
                max_length: int | None = None) -> dict[str, Any]:
    """Run lm-eval tasks on a checkpoint; returns the harness's per-task metrics."""
    register()
    import lm_eval
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=include_path) if include_path else None
    args = f"pretrained={model_dir},dtype={dtype},device={device}" + (f",max_length={max_length}" if max_length else "")
    res = lm_eval.simple_evaluate(model=MODEL_NAME, model_args=args, tasks=tasks, num_fewshot=num_fewshot,
                                  limit=limit, task_manager=tm, log_samples=False)
    if res is None:
        raise EvalError("lm_eval returned no results")
    return {"results": res.get("results", {}), "versions": res.get("versions", {}), "n-shot": res.get("n-shot", {})}
