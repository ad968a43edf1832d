"""lm-evaluation-harness model class `hylo` for HyLo (and HF) checkpoints, and the `hylo-lm-eval` command.

    hylo-lm-eval --model hylo --model_args pretrained=runs/hylo,dtype=bfloat16 --tasks arc_easy,gsm8k
    python -m hylo.pipeline.eval.lm_eval_adapter --model hylo ...           # the same without the console script
    lm_eval --model hf --model_args pretrained=runs/hylo,trust_remote_code=True --tasks ...   # stock harness

    from hylo.pipeline.eval.lm_eval_adapter import register
    register()                      # imports lm_eval; simple_evaluate(model="hylo", ...) in this process

Design choices:
* lm-eval 0.4 has no plugin entry points: its registry only knows what is imported in the process. The
  `hylo-lm-eval` console script (pyproject) registers "hylo" and then runs lm-eval's own CLI, so every
  lm-eval option works. Saved checkpoints also carry their model code, so the stock harness's `hf` model
  loads them with `trust_remote_code=True` (transformers' own generate(), padded batches included).
* Importing this module does not import lm_eval: the scoring logic lives in `Scorer`, which takes
  plain strings and works without the harness; `register()` builds the `lm_eval.api.model.LM`
  subclass around it and registers it under "hylo" (idempotent), after lm-eval's built-in names.
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
* generate_until: the model's `generate()` on left-padded batches of `batch_size` prompts (the
  requests' own generation kwargs: greedy unless they ask for sampling), stopping at EOS, at
  `max_gen_toks`, or when one of the `until` strings appears in a row's text (which is cut there).
* `run_lm_eval` (jobs/eval.py's lm_eval suite) loads each task first, so a task that cannot be loaded
  (unknown name, dataset not available offline) fails the job with one line naming it, before any
  scoring; it sets few-shot counts per task (None = the task's own default, e.g. gsm8k's 5), passes
  batch size, chat template, task metadata (RULER reads `max_seq_lengths` / `tokenizer` from it) and
  writes the harness's results (and samples with `log_samples`) under `output_path`.
* Progress bars (stderr) on every request loop, as the harness's own models show.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hylo.logs import get_logger
from hylo.pipeline.cli import report_error, report_interrupt
from hylo.pipeline.eval.decode import EvalError, eos_ids, is_hylo, load_model, load_tokenizer, pick_device
from hylo.pipeline.eval.progress import progress

logger = get_logger(__name__)

MODEL_NAME = "hylo"
DEFAULT_BATCH_SIZE = 8


# How to install lm-eval (the package's `eval` extra; also in `dev`).
LM_EVAL_HINT = "pip install 'hylo-pipeline[eval]' (or pip install lm-eval)"


def _batch_size(value: Any) -> int:
    """lm-eval passes an int, a digit string, or "auto"/"auto:N" (no memory probing here: the default)."""
    if value is None or (isinstance(value, str) and value.startswith("auto")):
        return DEFAULT_BATCH_SIZE
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise EvalError(f"batch_size={value!r} is not a positive integer or 'auto'") from None
    if n < 1:
        raise EvalError(f"batch_size={value!r} must be >= 1")
    return n


class _StopStrings:
    """Stopping criterion: a row is done once its new text contains one of `until` (decoding only the
    last few tokens each step, enough to hold the longest stop string)."""

    def __init__(self, tok: Any, until: list[str], start: int) -> None:
        self.tok, self.until, self.start = tok, until, start
        self.lookback = max(len(u) for u in until) + 4

    def __call__(self, input_ids: torch.Tensor, scores: Any = None, **kwargs: Any) -> torch.Tensor:
        new = input_ids[:, self.start:]
        tail = new[:, -self.lookback:].tolist()
        done = [any(u in self.tok.decode(row, skip_special_tokens=True) for u in self.until) for row in tail]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


class Scorer:
    """Log-likelihoods and generations of one causal LM on strings."""

    def __init__(self, model: nn.Module, tokenizer: Any, max_length: int | None = None,
                 max_batch_tokens: int = 8192, batch_size: int = 1) -> None:
        if tokenizer is None:
            raise EvalError("the lm-eval adapter needs a tokenizer (none found beside the model)")
        self.model = model
        self.tok = tokenizer
        self.max_length = int(max_length or getattr(model.config, "max_position_embeddings", 2048))
        self.max_batch_tokens = max(max_batch_tokens, self.max_length)
        self.batch_size = max(1, int(batch_size))
        self.eos = eos_ids(model, tokenizer)
        bos = getattr(tokenizer, "bos_token_id", None)
        self.prefix_token_id = int(bos) if bos is not None else (self.eos[0] if self.eos else 0)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else (self.eos[0] if self.eos else 0)
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
    def _continuation_logprobs(self, seqs: list[tuple[list[int], int]], desc: str | None = None,
                               disable_tqdm: bool = True) -> list[tuple[float, bool]]:
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
        bar = progress(total=len(seqs), desc=desc or "loglikelihood", unit="req", disable=disable_tqdm)
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
            bar.update(len(group))
        bar.close()
        return results  # type: ignore[return-value]

    def _fit(self, ctx: list[int], cont: list[int]) -> tuple[list[int], int]:
        if not cont:
            raise EvalError("loglikelihood: the continuation encodes to no tokens")
        tokens = (ctx + cont)[-(self.max_length + 1):]
        return tokens, min(len(cont), len(tokens) - 1)

    def loglikelihood(self, pairs: Iterable[tuple[str, str]], disable_tqdm: bool = True) -> list[tuple[float, bool]]:
        seqs = [self._fit(*self.encode_pair(c, x)) for c, x in pairs]
        return self._continuation_logprobs(seqs, "loglikelihood", disable_tqdm)

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

    def loglikelihood_rolling(self, texts: Iterable[str], disable_tqdm: bool = True) -> list[float]:
        texts = list(texts)
        out = []
        for text in progress(texts, desc="loglikelihood_rolling", unit="doc", disable=disable_tqdm):
            windows = self.rolling_windows(self.encode(text))
            out.append(sum(lp for lp, _ in self._continuation_logprobs(windows)) if windows else 0.0)
        return out

    @torch.no_grad()
    def generate_until(self, requests: Iterable[tuple[str, dict[str, Any]]], default_max_gen_toks: int = 256,
                       disable_tqdm: bool = True) -> list[str]:
        """Continuations cut at the first `until` string; left-padded batches of `batch_size` prompts
        that share their generation kwargs, longest first."""
        items = []
        for i, (context, kwargs) in enumerate(requests):
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_gen = int(kwargs.pop("max_gen_toks", default_max_gen_toks))
            ctx = self.encode(context) if context else [self.prefix_token_id]
            ctx = ctx[-max(1, self.max_length - max_gen):]
            items.append((i, ctx, until, max_gen, self._generation_kwargs(kwargs)))
        out: list[str | None] = [None] * len(items)
        groups: dict[str, list] = {}
        for item in items:
            groups.setdefault(repr((item[2], item[3], sorted(item[4].items()))), []).append(item)
        bar = progress(total=len(items), desc="generate_until", unit="req", disable=disable_tqdm)
        for group in groups.values():
            group.sort(key=lambda it: -len(it[1]))
            for b in range(0, len(group), self.batch_size):
                batch = group[b:b + self.batch_size]
                for (i, *_), text in zip(batch, self._generate_batch(batch)):
                    out[i] = text
                bar.update(len(batch))
        bar.close()
        return out  # type: ignore[return-value]

    @staticmethod
    def _generation_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
        """The request's sampling options for generate(); temperature 0 (the harness's default) is greedy."""
        kw = {k: v for k, v in kwargs.items() if k in ("do_sample", "temperature", "top_p", "top_k",
                                                        "repetition_penalty", "num_beams")}
        temp = float(kw.get("temperature", 0.0) or 0.0)
        if temp == 0.0 or not kw.get("do_sample", temp > 0):
            kw = {k: v for k, v in kw.items() if k not in ("temperature", "top_p", "top_k")}
            kw["do_sample"] = False
        return kw

    def _generate_batch(self, batch: list) -> list[str]:
        from transformers import StoppingCriteriaList  # lazy: transformers

        _, _, until, max_gen, gen_kw = batch[0]
        width = max(len(it[1]) for it in batch)
        ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for r, it in enumerate(batch):
            ids[r, width - len(it[1]):] = torch.tensor(it[1])
            mask[r, width - len(it[1]):] = 1
        stop = StoppingCriteriaList([_StopStrings(self.tok, until, width)]) if until else None
        seqs = self.model.generate(ids.to(self.device), attention_mask=mask.to(self.device), max_new_tokens=max_gen,
                                   eos_token_id=self.eos or None, pad_token_id=self.pad_token_id,
                                   stopping_criteria=stop, **gen_kw)
        texts = []
        for row in seqs[:, width:].tolist():
            # tokens after a row's EOS are padding
            for j, t in enumerate(row):
                if t in self.eos:
                    row = row[:j]
                    break
            text = self.tok.decode(row, skip_special_tokens=True)
            cut = min((text.index(u) for u in until if u in text), default=len(text))
            texts.append(text[:cut])
        return texts


_REGISTERED: dict[str, type] = {}


def register(name: str = MODEL_NAME) -> type:
    """Define the lm_eval `LM` subclass and register it under `name`; returns the class."""
    if name in _REGISTERED:
        return _REGISTERED[name]
    try:
        # lm-eval registers its own models (hf, vllm, ...) lazily when the registry is empty: do it first
        import lm_eval.models  # noqa: F401  # lazy: lm_eval
        from lm_eval.api.model import LM  # lazy: lm_eval
        from lm_eval.api.registry import register_model  # lazy: lm_eval
    except ImportError as e:
        raise EvalError(f"lm-evaluation-harness is not installed ({e}): {LM_EVAL_HINT}") from e

    class HyLoLM(LM):
        """`pretrained` = HyLo or HF checkpoint directory (or asset name)."""

        def __init__(self, pretrained: str | None = None, dtype: str = "float32", device: str | None = "auto",
                     max_length: int | None = None, max_batch_tokens: int = 8192, tokenizer: str | None = None,
                     model: nn.Module | None = None, tokenizer_obj: Any = None, batch_size: Any = None,
                     **unused: Any) -> None:
            super().__init__()
            if model is None:
                if pretrained is None:
                    raise EvalError("model_args needs pretrained=<checkpoint dir>")
                if device and str(device).startswith("cuda") and not torch.cuda.is_available():
                    # lm-eval's CLI asks for cuda unless told otherwise
                    logger.warning(f"[hylo-lm-eval] device {device} is not available; running on cpu")
                    device = "cpu"
                model = load_model(pretrained, dtype=dtype, device=device or "auto")
            if tokenizer_obj is None:
                tokenizer_obj = load_tokenizer(tokenizer or pretrained)
            self.scorer = Scorer(model, tokenizer_obj, max_length=int(max_length) if max_length else None,
                                 max_batch_tokens=int(max_batch_tokens), batch_size=_batch_size(batch_size))
            self._device = self.scorer.device
            self.pretrained = pretrained

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return self.scorer.loglikelihood([r.args for r in requests], disable_tqdm=disable_tqdm)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return self.scorer.loglikelihood_rolling([r.args[0] for r in requests], disable_tqdm=disable_tqdm)

        def generate_until(self, requests, disable_tqdm: bool = False):
            return self.scorer.generate_until([r.args for r in requests], disable_tqdm=disable_tqdm)

        @property
        def tokenizer_name(self) -> str:
            return str(getattr(self.scorer.tok, "name_or_path", "hylo")).replace("/", "__")

        def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
            return self.scorer.tok.apply_chat_template(chat_history, tokenize=False,
                                                       add_generation_prompt=add_generation_prompt)

        def chat_template(self, chat_template: bool | str = False) -> str | None:
            return getattr(self.scorer.tok, "chat_template", None) if chat_template else None

        def get_model_info(self) -> dict[str, Any]:
            m = self.scorer.model
            return {"model_num_parameters": sum(p.numel() for p in m.parameters()),
                    "model_dtype": str(next(m.parameters()).dtype), "model_kind": "hylo" if is_hylo(m) else "hf"}

    HyLoLM.__name__ = HyLoLM.__qualname__ = "HyLoLM"
    register_model(name)(HyLoLM)
    _REGISTERED[name] = HyLoLM
    return HyLoLM


def cli(argv: list[str] | None = None) -> int:
    """`hylo-lm-eval`: lm-eval's own command line with the `hylo` model registered. Without lm-eval installed:
    one `error:` line naming the extra to install, exit status 2."""
    try:
        register()
    except EvalError as e:
        report_error(str(e))
        return 2
    from lm_eval.__main__ import cli_evaluate  # lazy: lm_eval

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    try:
        cli_evaluate()
    except KeyboardInterrupt:
        return report_interrupt()
    return 0


# ------------------------------------------------------------------------------------ jobs/eval.py suite
def _load_error(name: str, e: BaseException) -> str:
    chain, c = [], e
    while c is not None and len(chain) < 6:
        chain.append(c)
        c = c.__cause__ or c.__context__
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, KeyError):
        return f"{name!r} is not a known task, group or tag (`lm-eval ls tasks` lists them; local YAML: lm_eval.include_path)"
    offline = any(isinstance(x, ConnectionError | FileNotFoundError | TimeoutError) or "Offline" in type(x).__name__
                  for x in chain)
    if offline:
        return (f"{name!r}: its dataset is not available ({type(e).__name__}: {first}). Offline, lm-eval reads "
                "datasets from the Hugging Face cache: run once where the Hub is reachable (or copy "
                "~/.cache/huggingface/datasets), or point lm_eval.include_path at a local task")
    return f"{name!r}: could not be loaded ({type(e).__name__}: {first})"


def load_tasks(task_manager: Any, names: list[str]) -> list[Any]:
    """The Task / Group objects of `names`, each loaded on its own; one EvalError lists every failure."""
    objs, errors = [], []
    for name in progress(names, desc="lm-eval tasks", unit="task", disable=len(names) < 2):
        try:
            loaded = task_manager.load([name])
        except Exception as e:  # noqa: BLE001 - the harness and datasets raise many kinds; each is reported
            errors.append(_load_error(name, e))
            continue
        if name in loaded["groups"]:
            objs.append(loaded["groups"][name])
        else:
            objs.extend(loaded["tasks"].values())
    if errors:
        raise EvalError("lm-eval tasks that cannot run: " + "; ".join(errors))
    return objs


def _leaf_tasks(objs: list[Any]) -> list[Any]:
    """Every Task under the loaded Task / Group objects."""
    out = []
    for o in objs:
        out.extend(o.get_all_tasks(recursive=True) if hasattr(o, "get_all_tasks") else [o])
    return out


def prepare_lm_eval(model_dir: str, cfg: Any) -> tuple[Any, list[Any]]:
    """Load the tasks of `cfg` (an `LMEvalSection`) with their few-shot counts: (task manager, task objects).
    Fails with one EvalError naming every task that cannot run."""
    register()
    from lm_eval.tasks import TaskManager  # lazy: lm_eval

    metadata = {"pretrained": str(model_dir), **dict(cfg.metadata or {})}
    if not cfg.include_defaults and not cfg.include_path:
        raise EvalError("lm_eval.include_defaults=false needs lm_eval.include_path (a directory of task YAMLs)")
    tm = TaskManager(include_path=cfg.include_path, include_defaults=cfg.include_defaults, metadata=metadata)
    objs = load_tasks(tm, list(cfg.tasks))
    per_task = dict(cfg.fewshot_per_task or {})
    leaves = {t.config.task for t in _leaf_tasks(objs)}
    unknown = sorted(set(per_task) - leaves)
    if unknown:
        raise EvalError(f"lm_eval.fewshot_per_task names {unknown}, which are not among the tasks {sorted(leaves)}")
    for task in _leaf_tasks(objs):
        n = per_task.get(task.config.task, cfg.num_fewshot)
        if n is not None:
            task.set_config(key="num_fewshot", value=int(n))
    return tm, objs


def run_lm_eval(model_dir: str, cfg: Any, dtype: str = "float32", device: str = "auto", model: nn.Module | None = None,
                tokenizer: Any = None, output_path: str | Path | None = None, seed: int = 0,
                prepared: tuple[Any, list[Any]] | None = None) -> dict[str, Any]:
    """Run the lm-eval tasks of `cfg` (an `LMEvalSection`) on a checkpoint; returns the harness's per-task
    metrics. `model` / `tokenizer`: already loaded objects to reuse (the `hylo` backend); `prepared`: what
    `prepare_lm_eval` returned, when the tasks were loaded ahead."""
    import lm_eval  # lazy: lm_eval

    tm, objs = prepared if prepared is not None else prepare_lm_eval(model_dir, cfg)
    if cfg.model == "hf":
        from lm_eval.api.registry import get_model  # lazy: lm_eval

        lm = get_model("hf")(pretrained=str(model_dir), trust_remote_code=True, dtype=dtype,
                             device=str(pick_device(device)), batch_size=cfg.batch_size, max_length=cfg.max_length)
    else:
        lm = register()(pretrained=str(model_dir), dtype=dtype, device=device, model=model, tokenizer_obj=tokenizer,
                        max_length=cfg.max_length, batch_size=cfg.batch_size)
    tracker = None
    if output_path is not None:
        from lm_eval.loggers import EvaluationTracker  # lazy: lm_eval

        tracker = EvaluationTracker(output_path=str(output_path))
    res = lm_eval.simple_evaluate(
        model=lm, tasks=objs, task_manager=tm, num_fewshot=None, batch_size=cfg.batch_size, limit=cfg.limit,
        log_samples=cfg.log_samples, evaluation_tracker=tracker, apply_chat_template=cfg.apply_chat_template,
        fewshot_as_multiturn=cfg.fewshot_as_multiturn if cfg.apply_chat_template else False,
        system_instruction=cfg.system_instruction, bootstrap_iters=cfg.bootstrap_iters,
        random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)
    if res is None:
        raise EvalError("lm_eval returned no results")
    samples = res.pop("samples", None) if cfg.log_samples else None
    if tracker is not None:
        tracker.general_config_tracker.model_name = str(model_dir)
        tracker.save_results_aggregated(results=res, samples=samples)
        for task_name in samples or {}:
            tracker.save_results_samples(task_name=task_name, samples=samples[task_name])
    return {"results": res.get("results", {}), "versions": res.get("versions", {}), "n-shot": res.get("n-shot", {}),
            "backend": cfg.model, "output_path": str(output_path) if output_path is not None else None}


if __name__ == "__main__":
    cli()
