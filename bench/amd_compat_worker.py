"""The side of bench/amd_compat.py that runs AMD's code: their real, unmodified modules from a checkout of
AMD-AGI/AMD-Hybrid-Models, in an environment of their pinned versions (transformers 4.43.1, Python 3.10),
with bench/amd_standins.py for mamba_ssm / causal_conv1d / flash_attn and their CUDA calls on the CPU.

    python bench/amd_compat_worker.py --repo DIR --side zebra|xecomla --job JOB.json --out DIR

It never imports this project. Tasks (JOB.json: {"tasks": [...]}) are run one by one, each result (or the
exception their code raised) written to DIR/results.json, tensors to DIR/<name>.safetensors:
* facts: what their config classes and layers say (fields, defaults, asserts, norm eps), for the driver to
  compare with hylo/released_facts.py;
* tree: {name: shape} of the module tree their loader builds from a directory's configs (no weights);
* load: their `from_pretrained(dir)` as a user calls it, in fp32 and fp64: the file's tensors it did not
  take, its parameters the file did not set (left at init), and logits on the given ids;
* infer (zebra): prefill + greedy decode through their `hybrid_inference` wrapper (matrix absorb off and on),
  the per-step logits it samples from;
* build: a model built by their own code (SVD / attention init from a random base their transformers saves),
  perturbed, saved as their training saves it (`save_pretrained` + their `save_config`), and its logits.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import re
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import amd_standins  # noqa: E402


def _setup(repo: Path, side: str) -> None:
    amd_standins.install()
    amd_standins.install_cpu_runtime()
    sys.path.insert(0, str(repo / ("Zebra-Llama" if side == "zebra" else "X-EcoMLA")))


def _read_ids(path: str) -> torch.Tensor:
    from safetensors.torch import load_file  # lazy: stand-ins

    return load_file(path)["ids"]


def _jsonable(v):
    if isinstance(v, tuple):
        return [_jsonable(x) for x in v]
    if isinstance(v, list):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    if v is inspect.Parameter.empty:
        return "<required>"
    return v


def _asserts(fn) -> list[list[str]]:
    """[[message, expression]] of the `assert EXPR, "MESSAGE"` lines of a function's source (`self.` dropped)."""
    src = inspect.getsource(fn)
    return [[m, re.sub(r"\s+", " ", e.replace("self.", "")).strip()]
            for e, m in re.findall(r"assert (.+?),\s*\"([^\"]*)\"", src)]


# ------------------------------------------------------------------------------------ facts
def facts(side: str) -> dict:
    if side == "zebra":
        from hybrid.hybrid_config import HybridConfig  # optional: amd
        from hybrid.mamba2.hybrid_mamba2_layer import Mamba2  # optional: amd
        from hybrid.mla.hybrid_mla_layer import (  # optional: amd
            DeepseekV3RMSNorm,
            DeepseekV3YarnRotaryEmbedding,
        )

        fields = {}
        for f in dataclasses.fields(HybridConfig):
            fields[f.name] = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        m2 = Mamba2(d_model=16, d_xb=8, d_inner=16, d_state=8, ngroups=2, expand=1, headdim=8, layer_idx=0)
        sig = inspect.signature(Mamba2.__init__).parameters
        return {"hybrid_config_fields": _jsonable(fields), "hybrid_config_asserts": _asserts(HybridConfig.__post_init__),
                "latent_norm_eps": DeepseekV3RMSNorm(4).variance_epsilon, "mamba_gated_norm_eps": m2.norm.eps,
                "mamba2_args": {k: _jsonable(p.default) for k, p in sig.items() if k not in ("self",)},
                "yarn_default_original": sig_default(DeepseekV3YarnRotaryEmbedding, "original_max_position_embeddings")}
    from mla.hybrid_mla_config import DeepseekV3Config, MLAConfig  # optional: amd

    fields = {}
    for f in dataclasses.fields(MLAConfig):
        if f.name != "deepseek_cfg":
            fields[f.name] = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    sig = inspect.signature(DeepseekV3Config.__init__).parameters
    return {"mla_config_fields": _jsonable(fields),
            "deepseek_v3_defaults": {k: _jsonable(p.default) for k, p in sig.items() if k not in ("self", "kwargs")},
            "deepseek_v3_asserts": _asserts(DeepseekV3Config.__init__)}


def sig_default(cls, name):
    return inspect.signature(cls.__init__).parameters[name].default


# ------------------------------------------------------------------------------------ their models
def _wrapper(side: str, d: str, dtype: torch.dtype):
    if side == "zebra":
        from hybrid.hybrid_wrapper import HybridModelWrapper  # optional: amd

        return HybridModelWrapper.from_pretrained(d, torch_dtype=dtype)
    from mla.hybrid_wrapper import MLATransformerHybridModelWrapper  # optional: amd

    return MLATransformerHybridModelWrapper.from_pretrained(d, torch_dtype=dtype)


def _logits(side: str, w, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Their forward as a user calls it (fp32); in fp64, their model's hidden states through their head, since
    Zebra-Llama's forward casts logits to fp32 at the end."""
    with torch.no_grad():
        if dtype == torch.float32 or side != "zebra":
            return w(ids).logits
        hidden = w.model.model(input_ids=ids, use_cache=False)[0]
        return w.model.lm_head(hidden)


def _accounting(w, d: str) -> dict:
    from safetensors.torch import load_file  # lazy: stand-ins

    files = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        files.update(load_file(f))
    sd = w.model.state_dict()
    loaded_ptrs = {sd[k].data_ptr() for k in files if k in sd}
    not_consumed = sorted(set(files) - set(sd))
    # a parameter tied to one the file set (X-EcoMLA's tied head) is not left at init
    at_init = sorted(k for k in set(sd) - set(files) if sd[k].data_ptr() not in loaded_ptrs)
    # what the loaded model holds against the file, both as fp64 (a loss on the way in would show here)
    differ = sorted(k for k in files if k in sd and not torch.equal(sd[k].double(), files[k].double()))
    return {"tensors": len(files), "not_consumed": not_consumed, "left_at_init": at_init, "value_differs": differ}


class _NormsInInputDtype:
    """Diagnostic only (--fp64-norms; not their code as written): their DeepseekV3RMSNorm and transformers
    4.43's LlamaRMSNorm compute in fp32 whatever the input dtype; inside this block they compute in it, so
    an fp64 run shows what is left once that rounding is gone."""

    def __enter__(self):
        import transformers.models.llama.modeling_llama as llama  # lazy: stand-ins

        mla = sys.modules.get("hybrid.mla.hybrid_mla_layer") or sys.modules.get("mla.hybrid_mla_layer")
        self.saved = [(cls, cls.forward) for cls in (mla.DeepseekV3RMSNorm, llama.LlamaRMSNorm)]

        def forward(self, h):
            return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

        for cls, _ in self.saved:
            cls.forward = forward
        return self

    def __exit__(self, *exc):
        for cls, fwd in self.saved:
            cls.forward = fwd


def load(side: str, task: dict, out: Path) -> dict:
    from safetensors.torch import save_file  # lazy: stand-ins

    ids = _read_ids(task["ids"])
    res, tensors = {}, {}
    runs = [("fp32", torch.float32), ("fp64", torch.float64)] + ([("fp64n", torch.float64)] if task.get("fp64_norms") else [])
    for name, dtype in runs:
        w = _wrapper(side, task["dir"], dtype)
        res[name] = _accounting(w, task["dir"])
        if name == "fp64n":
            with _NormsInInputDtype():
                tensors[name] = _logits(side, w, ids, dtype).contiguous()
        else:
            tensors[name] = _logits(side, w, ids, dtype).contiguous()
    save_file(tensors, str(out / f"{task['name']}.safetensors"))
    return res


def infer(side: str, task: dict, out: Path) -> dict:
    """Their hybrid_inference wrapper: prefill, then greedy decode of `new_tokens` with the scores it samples."""
    from hybrid_inference.hybrid_model_wrapper import HybridModelWrapper as InferenceWrapper  # optional: amd
    from safetensors.torch import save_file  # lazy: stand-ins

    ids = _read_ids(task["ids"])
    res, tensors = {}, {}
    for absorb in (False, True):
        m = InferenceWrapper.from_pretrained(task["dir"], torch_dtype=torch.float32, absorb=absorb)
        o = m.generate(ids, max_new_tokens=task["new_tokens"], do_sample=False, cg=False, output_scores=True,
                       return_dict_in_generate=True, eos_token_id=-1)
        key = "absorb" if absorb else "plain"
        tensors[f"{key}.sequences"] = o.sequences.contiguous()
        tensors[f"{key}.scores"] = torch.stack(list(o.scores), 1).float().contiguous()
        res[key] = {"steps": len(o.scores)}
    save_file(tensors, str(out / f"{task['name']}.safetensors"))
    return res


def tree(side: str, task: dict, out: Path) -> dict:
    """The module tree their loader builds from the directory's configs, with no weights read."""
    d = task["dir"]
    weights = [f for f in os.listdir(d) if f.endswith(".safetensors")]
    if weights:
        raise ValueError(f"{d}: the tree task reads configs only (found {weights})")
    w = _wrapper(side, d, torch.float32)
    return {"tree": {k: list(v.shape) for k, v in w.model.state_dict().items()}}


def _perturb(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype))


def build(side: str, task: dict, out: Path) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM  # lazy: stand-ins

    torch.manual_seed(task["seed"])
    base_dir = Path(task["out"]).with_name(Path(task["out"]).name + "-base")
    LlamaForCausalLM(LlamaConfig(**task["base"])).save_pretrained(base_dir)
    if side == "zebra":
        from hybrid.hybrid_config import HybridConfig  # optional: amd
        from hybrid.hybrid_wrapper import HybridModelWrapper  # optional: amd

        hc = HybridConfig(**task["hybrid_config"])
        w = HybridModelWrapper.init_distillation(None, str(base_dir), hc, hc.mla_layers, dtype=torch.float32,
                                                 init_with_svd=True, init_with_kqvo=True)
    else:
        from mla.hybrid_mla_config import DeepseekV3Config, MLAConfig  # optional: amd
        from mla.hybrid_wrapper import MLATransformerHybridModelWrapper  # optional: amd

        layer = DeepseekV3Config(**task["layer_config"])
        mc = MLAConfig(deepseek_cfg=layer, **task["mla_config"])
        # eager: their from_pretrained path checks for a GPU when flash_attention_2 is asked for (the
        # attention modules are replaced by their MLA layers either way); reloaded below as a user would
        w = MLATransformerHybridModelWrapper.init_distillation(None, str(base_dir), mc, attn_layers=mc.attn_layers,
                                                               dtype=torch.float32, attn_implementation="eager",
                                                               init_with_svd=True)
    _perturb(w.model, task["seed"] + 1)
    # what their training leaves: the trainer's save_pretrained of the causal LM, then their save_config
    w.model.save_pretrained(task["out"])
    w.save_config(task["out"], str(base_dir / "config.json"))
    return load(side, {**task, "dir": task["out"]}, out)


TASKS = {"facts": lambda side, task, out: facts(side), "load": load, "infer": infer, "tree": tree, "build": build}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--repo", required=True, type=Path)
    ap.add_argument("--side", required=True, choices=["zebra", "xecomla"])
    ap.add_argument("--job", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args(argv)
    _setup(args.repo, args.side)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for task in json.loads(args.job.read_text())["tasks"]:
        try:
            results[task["name"]] = {"ok": True, **TASKS[task["kind"]](args.side, task, args.out)}
        except Exception as e:  # their code's own error is the result (e.g. HybridConfig's TypeError)
            results[task["name"]] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                                     "where": traceback.format_exc().strip().splitlines()[-3:]}
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
