"""Memory and FLOPs of ONE training step at any shape, without the hardware: the step run on fake tensors.

    hylo estimate --config configs/llama-3.2-1b-8mla8gdn-64k.yaml                  # stage 2 at its seq_len
    hylo estimate --config configs/llama-3.2-1b-8mla8gdn-64k.yaml --tokens 8192,32768,65536,131072
    hylo estimate --config configs/demo-smollm2.yaml --stage 1 --world-size 1
    hylo estimate --config configs/llama-3.2-3b-14mla14gdn-64k.yaml --tokens 131072 --sequence-parallel 4

With `--sequence-parallel N` (one row split by tokens over N GPUs) the step below runs at T / N tokens, the
rank's share, and pipeline/train/estimate_sp.py adds what splitting adds and the bytes each layer sends.

Legend: T tokens of a packed row, W training workers (GPUs, the ZeRO-3 world size), P student parameters.

What runs: the stage's own step, `pipeline/train/stage1.train_step` / `stage2.train_step`, on the
config's student (`hylo/modeling.py`'s `HyLoForCausalLM` built from its config: the stage-1 checkpoint's
config.json where it exists, else the recipe's conversion options over the base's config), the teacher at
its shape (stage 2 in-process: the teacher's own `TeacherModel` over a model of its config; from the pool
or the cache: the top-k records or logit chunks the wire delivers), the fused KL in the configured form,
activation checkpointing as configured, AdamW, the step's dtype (bf16 on a GPU), `PlainEngine` in place of
DeepSpeed's engine (the step calls the same four methods of either). Every tensor is a FakeTensor (shapes,
dtypes, no data): a 64K step of the 1B recipe takes about 2.5 CPU-minutes here (the op count, not the
shapes, sets the time: the chunked scans loop over T / 64 chunks).

How it is measured:
* Memory: `torch.distributed._tools.mem_tracker.MemTracker` (the bytes of the storages live at each op;
  a GPU's allocator rounds each up to 512 bytes, negligible at these shapes) over one step after a warm-up step (so the optimizer states exist, as in a
  run). The loss's chunks are the fused KL's own peak over what was live when it started. Two artefacts
  of tracking are undone: MemTracker's hook on each parameter (it fails on frozen ones; replaced by a hook
  after accumulation) and, because autograd sums a tensor's gradients out of place whenever a Python
  dispatch mode is active, the copy each such sum makes that the step does not (`HostOps._engine_sum`).
  Checked against the CPU allocator's own peak of the same step (bench/estimate_check.py; 1.000 at 512
  tokens) and at a tiny shape in tests/train/test_estimate.py.
* FLOPs: `torch.utils.flop_counter.FlopCounterMode`'s formulas (`flop_registry`), counted per op in the
  same pass (under FlopCounterMode itself, whose module tracker keeps module outputs alive, the step's
  activation memory measured beside it more than doubled), split by phase: teacher forward,
  student forward, the fused loss (its logits, KL and both gradients are computed in its forward),
  backward (with the recomputed forward of checkpointed layers), optimizer. Attention is counted as torch
  counts it: dense within each SDPA call (causal kernels do about half of it). Time at a GPU's dense bf16
  peak is FLOPs / peak: a LOWER BOUND on the step time (no kernel reaches its peak, memory-bound ops and
  communication are not counted).
* ZeRO-3 is arithmetic on the real sizes, not simulated: the step runs at world size 1, then per GPU the
  student's parameters, gradients, fp32 master weights and AdamW moments (exact byte counts of the step's
  own tensors) are divided by W, moment by moment, as ZeRO-3 partitions them; the optimizer step's
  temporaries (fp32 gradient copies, foreach buffers) work on one partition and are divided by W too.
  Added per GPU for W > 1: the gathered parameters, at most DeepSpeed's live-parameter limit
  (`stage3_max_live_parameters`, 1e9 elements by default, which our config leaves as is), and one
  gradient reduce bucket (`deepspeed.reduce_bucket_size`). Not counted: the CUDA/HIP context, NCCL/RCCL
  buffers, allocator fragmentation: "fits" leaves `FIT_MARGIN` of the GPU's memory for them.
* Device reads: the step's tensors on the host (the packed row as read, its host boundaries and chunk
  layout) stay real tensors and run for real (`HostOps`), so whatever the code computes from them
  (boundaries, positions, the CPU fused KL's row selection) is exact. Reads of a device (fake) value have
  no value to give: each site that reads one is listed in `HOST_VALUES` with the value it gets (the step's
  loss sums and gradient norm, read once at its end for reporting; the fused KL's deferred input checks,
  "none failed"); a read anywhere else raises `EstimateError` naming the line.
* Kernels: fake tensors are CPU tensors, so the torch paths run (the chunked GDN / SSD scans, the fused
  KL's torch chunk step; SDPA takes its flash path, O(T) memory). On a GPU fla's and the Triton kernels
  hold fewer intermediates inside one layer's backward: with activation checkpointing that is a
  one-layer transient, so the estimate errs high there. `gpu=True` (the default) gives the step the
  accelerator's rules where they change memory: the fused KL's deferred checks (every row through the
  chunks, masked ones zeroed) and its chunk size as a GPU picks it (`auto_chunk_size` for a GPU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import math
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hylo.pipeline.data.rows import PackedRow, check_row
from hylo.pipeline.train.config import DataSection, Stage1Config, Stage2Config, StageConfig, SyntheticData
from hylo.pipeline.train.plain_engine import PlainEngine
from hylo.pipeline.train.worker import WorkerContext

GIB = 1 << 30
# share of a GPU's memory left for what the estimate does not count (context, communication buffers,
# allocator fragmentation)
FIT_MARGIN = 0.10
# DeepSpeed's default limit of gathered parameter elements (stage3_max_live_parameters)
ZERO3_MAX_LIVE_PARAMETERS = 1_000_000_000
# rows of the documents of the synthetic row: ShareGPT-like conversations (design.md section 9)
DOC_TOKENS = (256, 2048)


# The longest row `hylo estimate` takes. The step runs on fake tensors in time linear in T (the chunked scans
# loop over T / 64 chunks): 3-4 ms of CPU per token for the 1B and 3B recipes (their 128K rows took 7 and 8.5
# minutes, README), so 2^20 tokens take about an hour; the packed row itself is a real host tensor (its ids,
# positions, labels: 2^40 tokens would be terabytes). `MAX_ESTIMATE_TOTAL` bounds the sum of --tokens.
MAX_ESTIMATE_TOKENS = 1 << 20
MAX_ESTIMATE_TOTAL = 2 * MAX_ESTIMATE_TOKENS
# --world-size: the ZeRO-3 world the per-GPU figures divide by (65,536 GPUs is beyond any training cluster).
MAX_WORLD_SIZE = 1 << 16
# Seconds between two progress lines inside one phase of the measured step (per layer); phase changes always print.
PROGRESS_EVERY_S = 10.0


class EstimateError(RuntimeError):
    """The step cannot run on fake tensors as it is (it reads a device value the estimate has none for)."""


# ------------------------------------------------------------------------------------ the GPUs
@dataclass(frozen=True)
class GPU:
    name: str
    # what a process can allocate, as nvidia-smi / rocm-smi report the device's memory
    memory_gib: float
    # dense (no sparsity) bf16 matrix peak, the vendor's figure
    bf16_tflops: float

    def fits(self, peak_bytes: float) -> bool:
        return peak_bytes <= (1 - FIT_MARGIN) * self.memory_gib * GIB

    def seconds(self, flops: float) -> float:
        return flops / (self.bf16_tflops * 1e12)


GPUS = (
    GPU("H100", 79.6, 989.4),      # H100 SXM 80 GB: 81,559 MiB
    GPU("H200", 140.4, 989.4),     # H200 SXM 141 GB: 143,771 MiB
    GPU("MI300X", 191.7, 1307.4),  # 192 GB HBM3
    GPU("MI355X", 288.0, 2516.6),  # 288 GB HBM3E (nominal)
)


# ------------------------------------------------------------------------------------ model shapes
# config.json of the published bases and teachers the recipes name, for a machine where their directories
# are not mounted (the estimate needs the shapes only; a directory that exists is read instead)
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "Llama-3.2-1B-Instruct": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                  num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                                  rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True,
                                  rms_norm_eps=1e-5),
    "Llama-3.2-3B-Instruct": dict(model_type="llama", hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                                  num_attention_heads=24, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                                  rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True,
                                  rms_norm_eps=1e-5),
    "Llama-3.1-8B-Instruct": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                                  rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=False,
                                  rms_norm_eps=1e-5),
    "Qwen3-1.7B": dict(model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=True,
                       rms_norm_eps=1e-6),
    "Qwen3-8B": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False,
                     rms_norm_eps=1e-6),
}


def model_config(path: str, what: str):
    """The transformers config of a model directory, an asset, or a published model named by its directory."""
    from transformers import AutoConfig

    from hylo.assets import asset_name, resolve_path_or_asset
    from hylo.pipeline.config import ConfigError

    p = Path(str(path)).expanduser()
    if asset_name(path) is not None or (p / "config.json").is_file():
        from hylo.files import read_json
        from hylo.model_files import ModelFileError, check_model_config

        d = resolve_path_or_asset(path, what, directory=True)
        # its fields within what a model can be built from (one line naming the file and the field)
        check_model_config(read_json(d / "config.json", ModelFileError, mapping=True), d / "config.json")
        return AutoConfig.from_pretrained(d)
    known = KNOWN_MODELS.get(p.name)
    if known is None:
        raise ConfigError(f"{what}={path}: no config.json there and not a published model this estimate knows "
                          f"({', '.join(KNOWN_MODELS)}); point it at a directory holding the model's config.json",
                          what)
    return AutoConfig.for_model(**known)


@dataclass
class Shapes:
    """What the step is built from: the student's HybridConfig, and the base (stage 1) or teacher config."""

    student: Any
    base: Any | None = None
    teacher: Any | None = None


def student_config(cfg: StageConfig, stage1: Stage1Config | None):
    """The student's HybridConfig: its checkpoint's config where it exists, else the conversion of the base."""
    from hylo.config import HybridConfig
    from hylo.pipeline.config import ConfigError
    from hylo.upcycle.options import hybrid_config_from_base

    if cfg.model.student and (Path(cfg.model.student).expanduser() / "config.json").is_file():
        return HybridConfig.from_pretrained(Path(cfg.model.student).expanduser())
    s1 = cfg if isinstance(cfg, Stage1Config) else stage1
    if s1 is None or not s1.model.base:
        raise ConfigError("model.student has no config.json and the config has no stage-1 model.base to convert: "
                          "the estimate cannot know the student's shape", "model.student")
    import warnings

    with warnings.catch_warnings():
        # the base's RoPE scaling is replaced by YaRN in the MLA layers (the converter warns)
        warnings.simplefilter("ignore")
        return hybrid_config_from_base(model_config(s1.model.base, "model.base"), s1.model.convert)


def shapes_of(cfg: StageConfig, stage1: Stage1Config | None = None) -> Shapes:
    from hylo.pipeline.teacher.sources import source_kind

    shapes = Shapes(student_config(cfg, stage1))
    if isinstance(cfg, Stage1Config):
        shapes.base = model_config(cfg.model.base, "model.base")
    elif source_kind(cfg.teacher.source).model_runs:
        shapes.teacher = model_config(cfg.teacher.model.path, "teacher.model.path")
    return shapes


def parameter_count(config: Any) -> int:
    """Parameters of a model of this config (built on fake tensors: exact, no memory)."""
    with fake_tensors():
        model = _build_model(config, torch.float32)
        return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------ fake tensors
# (file suffix, function) of every read of a device value in a step -> the value it gets, and why
HOST_VALUES: dict[tuple[str, str], tuple[Any, str]] = {
    ("pipeline/train/stage2.py", "train_step"): (0.0, "the step's loss sums, read once at its end"),
    ("pipeline/train/stage1.py", "train_step"): (0.0, "the step's loss terms (reporting)"),
    ("kernels/fused_kl/inputs.py", "check_deferred"): (False, "the fused KL's deferred input checks: none failed"),
    # the CPU rule (gpu=False): the same checks of the inputs' values, made at once (bool reads only)
    ("kernels/fused_kl/inputs.py", "*"): (False, "the fused KL's input value checks (NaN, ranges): they pass"),
    ("kernels/fused_kl/chunked.py", "backward"): (False, "grad_output == 1? No: the step scales its loss by W / n_global"),
    ("pipeline/train/plain_engine.py", "get_global_grad_norm"): (0.0, "the clipped gradient norm (reporting)"),
}
_HERE = "pipeline/train/estimate.py"
GEMM_OPS = frozenset({"mm", "addmm", "addmm_", "bmm", "baddbmm"})


def _call_site() -> traceback.FrameSummary | None:
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace("\\", "/")
        if "/torch/" in path or path.endswith(_HERE):
            continue
        return frame
    return None


class HostOps(torch.utils._python_dispatch.TorchDispatchMode):
    """Under FakeTensorMode: an op whose tensors are all real (host data: the row as read, its boundaries)
    runs for real; a read of a fake (device) value gets its site's `HOST_VALUES` entry or raises."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        # FlopCounterMode's formulas (op -> FLOPs from shapes) while counting, else None
        self.flop_registry: dict | None = None
        self.flops = 0
        # (op, operand shapes) -> [calls, FLOPs] of the matrix products counted (the bench replays them)
        self.gemms: dict[tuple[str, tuple], list[int]] = {}
        # bytes of the sum the engine makes in place while the tracker sees it out of place (`_engine_sum`)
        self.credit = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import (
            DataDependentOutputException,
            DynamicOutputShapeException,
            FakeTensor,
            unset_fake_temporarily,
        )
        from torch.utils._pytree import tree_leaves

        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            return self._host_value(args[0])
        if tensors and not any(isinstance(t, FakeTensor) for t in tensors):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        # the credit of the previous op's in-place sum ends here: the tracker (above this mode) has seen it
        self.credit = self._engine_sum(func, args, kwargs)
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException) as e:
            raise EstimateError(f"{func} at {_where()}: its output's size depends on device values, which the "
                                f"estimate does not have ({type(e).__name__})") from None
        if self.flop_registry is not None:
            formula = self.flop_registry.get(func._overloadpacket)
            if formula is not None:
                n = formula(*args, **kwargs, out_val=out)
                self.flops += n
                name = func._overloadpacket.__name__
                if name in GEMM_OPS:
                    key = (name, tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)))
                    entry = self.gemms.setdefault(key, [0, 0])
                    entry[0] += 1
                    entry[1] += n
        return out

    @staticmethod
    def _engine_sum(func, args, kwargs) -> int:
        """Bytes of a sum autograd's engine makes in place but the tracker sees out of place, else 0.

        The engine sums the gradients a tensor receives from several uses (a residual stream, a tied
        weight) into its input buffer IN PLACE, unless a tensor is "subclass-like", which every tensor is
        while a Python dispatch mode is active (torch/csrc/autograd/input_buffer.cpp): under the tracker
        each such sum allocates a copy the step does not make. Such a sum is an `add` of two same-shaped
        tensors called from the engine itself (no Python frame between `_engine_run_backward` and the op);
        while it runs, its output's bytes are credited."""
        import sys

        if func is not torch.ops.aten.add.Tensor or kwargs or len(args) != 2:
            return 0
        a, b = args
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
            return 0
        # the innermost frame outside torch's dispatch plumbing (and the tracker), or the engine's own
        frame = sys._getframe(2)
        while frame is not None and "/torch/" in frame.f_code.co_filename.replace("\\", "/") \
                and frame.f_code.co_name != "_engine_run_backward":
            frame = frame.f_back
        if frame is None or frame.f_code.co_name != "_engine_run_backward":
            return 0
        return a.numel() * a.element_size()

    def _host_value(self, t: torch.Tensor) -> Any:
        site = _call_site()
        path = site.filename.replace("\\", "/") if site else "?"
        for (suffix, function), (value, _why) in HOST_VALUES.items():
            if site is None or not path.endswith(suffix) or function not in (site.name, "*"):
                continue
            if function == "*" and t.dtype != torch.bool:
                continue
            if True:
                self.reads.append(f"{suffix}:{site.lineno} ({function})")
                if t.dtype == torch.bool:
                    return bool(value)
                return float(value) if t.dtype.is_floating_point else int(value)
        raise EstimateError(f"the step reads a device value ({t.dtype}) at {_where()}: the estimate has no "
                            "value for it; give the code the host value it needs, or list the site in "
                            "pipeline/train/estimate.HOST_VALUES with the value it reads")


def _where() -> str:
    site = _call_site()
    return "?" if site is None else f"{site.filename}:{site.lineno} ({site.name})"


@contextlib.contextmanager
def _noop_conversions() -> Iterator[None]:
    """`module.to(device, dtype)` that changes nothing returns the module: under FakeTensorMode torch swaps
    every parameter even then, and fails on the fake mode's own weak references."""
    original = nn.Module._apply

    def _apply(self, fn, recurse=True):
        with torch.no_grad():
            if all(fn(t) is t for t in itertools.chain(self.parameters(), self.buffers())):
                return self
        return original(self, fn, recurse)

    nn.Module._apply = _apply  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module._apply = original  # type: ignore[method-assign]


@contextlib.contextmanager
def fake_tensors() -> Iterator[HostOps]:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hylo.kernels import packed_sdpa
    from hylo.kernels.fused_kl import inputs

    host = HostOps()
    # process-wide caches must not hand fake tensors to a real step later (nor real ones in): the grouped
    # attention's index tensors, the fused KL's deferred check flags (read here, as the step's end does)
    packed_sdpa._indices.cache_clear()
    with FakeTensorMode(allow_non_fake_inputs=True), _noop_conversions(), host:
        try:
            yield host
        finally:
            inputs.check_deferred()
            packed_sdpa._indices.cache_clear()


def _build_model(config: Any, dtype: torch.dtype) -> nn.Module:
    """A model of `config` in `dtype` (HyLo or any transformers causal LM), built on the current mode."""
    from hylo.config import HybridConfig

    if isinstance(config, HybridConfig):
        from hylo.modeling import HyLoForCausalLM

        model = HyLoForCausalLM._from_config(config, dtype=dtype)
    else:
        from transformers import AutoModelForCausalLM

        config._attn_implementation = "sdpa"
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return cast_parameters(model, dtype)


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Every floating parameter in `dtype`, as a checkpoint loaded in it (`load_hylo(path, dtype)`) has them,
    also those a layer creates in fp32 (GDN's A_log, dt_bias); rebound, not converted (fake parameters
    cannot be swapped in place, which `module.to(dtype)` does)."""
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and p.is_floating_point() and p.dtype != dtype:
                mod._parameters[name] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
    return model


def fake_like(tree: Any) -> Any:
    """Fake CPU tensors of the shapes, dtypes and requires_grad of the real tensors in `tree` (under
    `fake_tensors()`): a measured call's inputs for its estimate."""
    from torch.utils._pytree import tree_map

    def like(x):
        if not isinstance(x, torch.Tensor):
            return x
        return torch.empty(x.shape, dtype=x.dtype).requires_grad_(x.requires_grad)

    return tree_map(like, tree)


# ------------------------------------------------------------------------------------ tracking
class _NoHook:
    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


def _grad_reftype():
    from torch.distributed._tools.mem_tracker import _MemRefType

    return _MemRefType.GRAD

class StepMemory:
    """MemTracker over the measured step, with the per-GPU figure of ZeRO-3 over W workers at every op."""

    def __init__(self, world_size: int, host: HostOps | None = None) -> None:
        from torch.distributed._tools.mem_tracker import MemTracker

        outer = self
        self.host = host

        class Tracker(MemTracker):
            def _update_peak_stats(self, peak_state):  # noqa: N805 - MemTracker's hook, after every op
                # in place of MemTracker's per-module peaks (a walk over every module at every op, which
                # the estimate does not use): the per-GPU figure
                outer._observe(self._curr_mem_snap)

            def _track_module_params_and_buffers(self, module, install_grad_hooks=True):  # noqa: N805
                # MemTracker hooks every parameter's gradient and fails on frozen ones (the teacher, the
                # base, stage 1's untrained layers): they never get one, so they get no hook
                # a hook on the parameter tensor itself also makes autograd accumulate a second gradient
                # (a tied weight's) out of place, a copy the step does not make: only the hook after
                # accumulation is installed
                for p in module.parameters():
                    if not install_grad_hooks or self._param_to_grad_hook_handles.get(p) is not None:
                        continue
                    post = _NO_HOOK
                    if p.requires_grad:
                        post = p.register_post_accumulate_grad_hook(self._mark_grad)
                    self._param_to_grad_hook_handles[p] = (_NO_HOOK, post)
                return super()._track_module_params_and_buffers(module, install_grad_hooks)

            def _mark_grad(self, param):  # noqa: N805
                self._update_and_maybe_create_winfos(param.grad, _grad_reftype())

            def _pre_fw_hook(self, module, inputs):  # noqa: N805
                # a root module called again in the same step (the teacher's per-length forwards, one
                # row per micro-batch) is tracked afresh: MemTracker refuses it, its per-module stats
                # (which the estimate does not use) would mix the calls
                if module in self.memory_tracking and not self._mod_tracker.is_bw:
                    parents = set(self._mod_tracker.parents) - {self._mod_tracker.get_known_fqn(module)}
                    if parents == {"Global"}:
                        del self.memory_tracking[module]
                return super()._pre_fw_hook(module, inputs)

        self.tracker = Tracker()
        self.world = world_size
        self.sharded_static = 0  # student parameters + fp32 masters + AdamW moments (bytes)
        self.phase = "before"
        self.step_floor: float | None = None
        self.peak = 0.0
        # the per-GPU peak at other world sizes of the same step (tables): W -> bytes, before ZeRO-3's extras
        self.other_worlds: tuple[int, ...] = ()
        self.other_peaks: dict[int, float] = {}
        self.phase_peaks: dict[str, float] = {}
        self.at_peak: dict[str, Any] = {}
        self.windows: list[list[float]] = []
        self.active = False

    @staticmethod
    def _snap(snap: dict) -> dict[str, int]:
        dev = next(iter(snap.values()), None)
        return {str(k.value if hasattr(k, "value") else k): v for k, v in (dev or {}).items()}

    def total(self) -> int:
        return self._snap(self.tracker._curr_mem_snap).get("Total", 0)

    def _observe(self, snap: dict) -> None:
        if not self.active:
            return
        s = self._snap(snap)
        total, grads = s.get("Total", 0) - (self.host.credit if self.host is not None else 0), s.get("Gradient", 0)
        W = self.world
        if self.phase == "optimizer":
            floor = self.step_floor or 0.0
            per_gpu = floor + (total - floor) / W
        else:
            state = self.sharded_static + grads
            per_gpu = total - state + state / W
        for w in self.windows:
            w[1] = max(w[1], total)
        for other in self.other_worlds:
            if self.phase == "optimizer":
                floor = self.step_floor or 0.0
                x = floor + (total - floor) / other
            else:
                x = total - (self.sharded_static + grads) * (1 - 1 / other)
            self.other_peaks[other] = max(self.other_peaks.get(other, 0.0), x)
        if per_gpu > self.phase_peaks.get(self.phase, 0.0):
            self.phase_peaks[self.phase] = per_gpu
        if per_gpu > self.peak:
            self.peak = per_gpu
            self.at_peak = {"phase": self.phase, "total": total, "gradients": grads, **s}

    @contextlib.contextmanager
    def window(self) -> Iterator[list[float]]:
        """[total at entry, highest total inside] of a block (the fused loss)."""
        w = [float(self.total()), float(self.total())]
        self.windows.append(w)
        try:
            yield w
        finally:
            self.windows.remove(w)


class Phases:
    """FLOPs per phase of the step (deltas of the count) and the memory phase markers."""

    def __init__(self, counter: HostOps, memory: StepMemory, progress: Progress | None = None) -> None:
        self.counter, self.memory, self.progress = counter, memory, progress
        self.flops: dict[str, int] = {}
        self.stack: list[str] = ["other"]
        self.last = 0
        self.loss_peaks: list[float] = []

    def _account(self) -> None:
        now = self.counter.flops
        self.flops[self.stack[-1]] = self.flops.get(self.stack[-1], 0) + now - self.last
        self.last = now

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._account()
        if self.progress is not None and name not in self.stack:
            self.progress.phase(name)
        self.stack.append(name)
        try:
            yield
        finally:
            self._account()
            self.stack.pop()


class TrackedEngine(PlainEngine):
    """PlainEngine, marking the step's phases (forward, backward, optimizer) for the counters."""

    phases: Phases | None = None

    def _phase(self, name: str):
        return self.phases.phase(name) if self.phases is not None else contextlib.nullcontext()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._phase("student forward"):
            return super().__call__(*args, **kwargs)

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = False) -> None:
        with self._phase("backward (with recompute)"):
            super().backward(loss, scale_wrt_gas)

    def step(self) -> None:
        mem = self.phases.memory if self.phases is not None else None
        if mem is not None and mem.active:
            s = mem._snap(mem.tracker._curr_mem_snap)
            credit = mem.host.credit if mem.host is not None else 0
            mem.step_floor = s.get("Total", 0) - credit - mem.sharded_static - s.get("Gradient", 0)
            mem.phase = "optimizer"
        with self._phase("optimizer"):
            super().step()
        if mem is not None:
            mem.phase = "forward/backward"


@contextlib.contextmanager
def _loss_marked(phases: Phases) -> Iterator[None]:
    """The fused loss's chunk loop (`_forward_backward`, which fused_linear_kl_div and the fused CE call)
    counted as its own phase, with its memory window."""
    from hylo.kernels.fused_kl import chunked

    original = chunked._forward_backward

    @functools.wraps(original)
    def marked(*args, **kwargs):
        with phases.phase("fused loss"), phases.memory.window() as w:
            out = original(*args, **kwargs)
        phases.loss_peaks.append(w[1] - w[0])
        return out

    chunked._forward_backward = marked
    try:
        yield
    finally:
        chunked._forward_backward = original


class _MarkedSource:
    """A teacher source whose computation counts as the 'teacher forward' phase."""

    def __init__(self, source: Any, phases: Phases) -> None:
        self.source, self.phases = source, phases

    def targets(self, rows, spec):
        it = iter(self.source.targets(rows, spec))
        while True:
            with self.phases.phase("teacher forward"):
                try:
                    item = next(it)
                except StopIteration:
                    return
            yield item


class _WireTopK:
    """The top-k records a Serve pool or the offline cache hands the step (logprobs [T, k] in the wire
    dtype, indices [T, k] int32, tail mass [T] fp32), on the step's device."""

    def __init__(self, k: int, dtype: torch.dtype) -> None:
        self.k, self.dtype = k, dtype

    def targets(self, rows, spec):
        from hylo.kernels.fused_kl.topk import TeacherTopK

        for r in rows:
            T = r.num_tokens
            yield {"teacher_topk": TeacherTopK(torch.zeros(T, self.k, dtype=self.dtype),
                                               torch.zeros(T, self.k, dtype=torch.int32),
                                               torch.zeros(T, dtype=torch.float32))}


class _WireLogits:
    """Full-vocabulary logit chunks [C, V] as the pool streams them (the client's dtype)."""

    def __init__(self, vocab: int, chunk: int, dtype: torch.dtype) -> None:
        self.vocab, self.chunk, self.dtype = vocab, chunk, dtype

    def targets(self, rows, spec):
        from hylo.pipeline.teacher.protocol import StreamedLogits

        for r in rows:
            T = r.num_tokens
            chunks = (torch.zeros(min(self.chunk, T - s), self.vocab, dtype=self.dtype) for s in range(0, T, self.chunk))
            yield {"teacher_logits_fn": StreamedLogits(chunks)}


class _Solo(WorkerContext):
    """One rank; its all-reduce is the identity (the estimate's rank is every rank)."""

    def all_sum(self, values):
        return list(values)

    def all_max(self, values):
        return list(values)


# ------------------------------------------------------------------------------------ the step
@dataclass
class Estimate:
    stage: int
    tokens: int
    world_size: int
    dtype: str
    parameters: int
    trainable_parameters: int
    # per GPU, bytes
    memory: dict[str, float]
    peak_bytes: float
    peak_phase: str
    loss_chunk_bytes: float
    flops: dict[str, int]
    host_reads: list[str]
    # per GPU at the step's start (states, frozen weights) and the peak of each phase of the step
    start_bytes: float = 0.0
    phase_peaks: dict[str, float] = field(default_factory=dict)
    peaks_by_world: dict[int, float] = field(default_factory=dict)
    # (op, operand shapes, calls, FLOPs) of the step's matrix products, largest first
    gemms: list[tuple[str, tuple, int, int]] = field(default_factory=list)
    teacher_parameters: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def total_flops(self) -> int:
        return sum(self.flops.values())

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["total_flops"] = self.total_flops
        d["gpus"] = {g.name: {"fits": g.fits(self.peak_bytes), "seconds_at_bf16_peak": g.seconds(self.total_flops)}
                     for g in GPUS}
        return d


def synthetic_row(tokens: int, vocab: int, doc_tokens: tuple[int, int] = DOC_TOKENS, seed: int = 0) -> PackedRow:
    """A packed row of `tokens` tokens (documents of random length in `doc_tokens`, the second half of each
    scored), as the training reader yields it: `pipeline/train/rows.SyntheticRows`, checked."""
    from hylo.pipeline.train.row_sources import SyntheticRows

    lo, hi = min(doc_tokens[0], tokens), min(doc_tokens[1], tokens)
    data = DataSection(source="synthetic", seq_len=tokens, synthetic=SyntheticData(vocab_size=vocab, min_doc_len=lo,
                                                                                   max_doc_len=hi))
    return check_row(SyntheticRows(data, seed).raw(0))


def _state_bytes(tensors) -> int:
    """Bytes of distinct storages, as MemTracker counts CPU storages (exact: it rounds CUDA ones only)."""
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if id(st) in seen:
            continue
        seen.add(id(st))
        total += st.nbytes()
    return total


def _optimizer_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]


def build_stage2(cfg: Stage2Config, shapes: Shapes, dtype: torch.dtype, gpu: bool, engine_cls=None):
    """Stage 2's task as `stage2.build` makes it, on the current (fake) mode: the student of `shapes`, the
    configured teacher, KDStudent, and a (Tracked)PlainEngine."""
    from hylo.pipeline.teacher.model import TeacherModel, torch_dtype
    from hylo.pipeline.teacher.protocol import BoundTeacher, TargetSpec
    from hylo.pipeline.teacher.sources import source_kind
    from hylo.pipeline.train.stage2 import KDStudent, Stage2Task

    student = _build_model(shapes.student, dtype)
    if cfg.model.activation_checkpointing:
        student.gradient_checkpointing_enable()
    student.train()
    # ZeRO-3's external-parameter registration needs DeepSpeed's engine; the estimate shards by arithmetic
    module = KDStudent(student, dataclasses.replace(cfg, deepspeed=dataclasses.replace(cfg.deepspeed, zero_stage=0)))
    engine = _engine(module, cfg, engine_cls, gpu)
    t = cfg.teacher
    spec = TargetSpec(t.k, t.form)
    vocab = shapes.student.vocab_size
    teacher_model = None
    if source_kind(t.source).model_runs == "step":
        teacher_model = _build_model(shapes.teacher, torch_dtype(t.model.dtype))
        m = t.model
        source: Any = TeacherModel(teacher_model, dtype=m.dtype, device="cpu", isolation=m.isolation,
                                   logits_chunk_tokens=m.logits_chunk_tokens, max_forward_tokens=m.max_forward_tokens)
    elif spec.form == "topk":
        source = _WireTopK(t.k, torch_dtype(t.client.dtype))
    else:
        source = _WireLogits(vocab, t.model.logits_chunk_tokens, torch_dtype(t.client.dtype))
    return Stage2Task(engine, student, BoundTeacher(source, spec, vocab), cfg), teacher_model


def build_stage1(cfg: Stage1Config, shapes: Shapes, dtype: torch.dtype, gpu: bool, engine_cls=None):
    """Stage 1's task as `stage1.build` makes it: the frozen base, the student's trainable parameters,
    ILDStudent, and a (Tracked)PlainEngine."""
    from hylo.pipeline.train.stage1 import BaseLayerTargets, ILDStudent, Stage1Task, trainable_parameters

    student = _build_model(shapes.student, dtype)
    base = _build_model(shapes.base, dtype).eval()
    base.requires_grad_(False)
    trainable_parameters(student, cfg.ild.trainable)
    student.train()
    module = ILDStudent(student, cfg)
    engine = _engine(module, cfg, engine_cls, gpu)
    return Stage1Task(engine, student, BaseLayerTargets(base), cfg), base


def _engine(module: nn.Module, cfg: StageConfig, engine_cls=None, gpu: bool = False) -> PlainEngine:
    o = cfg.optim
    cls = engine_cls or TrackedEngine
    engine = cls(module, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, grad_clip=o.grad_clip)
    if gpu:
        # AdamW's multi-tensor form, torch's default for GPU tensors (on CPU ones it loops per tensor): its
        # temporaries span every tensor of the partition at once, as DeepSpeed's step over a flat partition
        engine.optimizer = torch.optim.AdamW(engine.masters, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                                             weight_decay=o.weight_decay, foreach=True)
    return engine


def flop_registry() -> dict:
    """torch.utils.flop_counter.FlopCounterMode's formulas (op -> FLOPs from its shapes), with those of the
    ops our CPU step runs that it lacks: SDPA's CPU flash kernel (as its CUDA flash kernel: dense), the
    fused loss's in-place `addmm_`, GDN's triangular solve.

    Counted in `HostOps` rather than under FlopCounterMode itself: its module tracker keeps every module's
    outputs alive, which more than doubled the step's activation memory measured beside it."""
    from torch.utils.flop_counter import (
        FlopCounterMode,
        addmm_flop,
        sdpa_backward_flop_count,
        sdpa_flop_count,
    )

    aten = torch.ops.aten

    def cpu_flash(query, key, value, *args, out_shape=None, **kwargs):
        return sdpa_flop_count(query, key, value)

    def cpu_flash_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs):
        return sdpa_backward_flop_count(grad_out, query, key, value)

    def addmm_inplace(self_shape, a_shape, b_shape, *args, out_shape=None, **kwargs):
        return addmm_flop(self_shape, a_shape, b_shape)

    def solve_triangular(a_shape, b_shape, *args, out_shape=None, **kwargs):
        # forward substitution: n^2 multiply-adds per right-hand side
        *batch, n, _ = a_shape
        return math.prod(batch) * n * n * b_shape[-1]

    return FlopCounterMode(display=False, custom_mapping={
        aten._scaled_dot_product_flash_attention_for_cpu: cpu_flash,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: cpu_flash_backward,
        aten.addmm_: addmm_inplace,
        aten.linalg_solve_triangular: solve_triangular,
    }).flop_registry


def gpu_chunk_size(tokens: int, vocab: int) -> int:
    """The fused KL's chunk rows as a GPU picks them (fp32 compute, the accelerator's byte budget)."""
    from hylo.kernels.fused_kl.chunked import auto_chunk_size

    return auto_chunk_size(tokens, vocab, torch.device("cuda"), torch.float32)


class Progress:
    """Progress lines of a long estimate on stderr: each phase of the measured step as it starts, and the
    layer it is in at most every `PROGRESS_EVERY_S` seconds (a 128K row of a 3B model takes minutes).
    `say(text)` prints `prefix: text`; `watch(model, what)` hooks the model's decoder layers."""

    def __init__(self, prefix: str, every_s: float = PROGRESS_EVERY_S) -> None:
        import time

        self.prefix, self.every_s, self._clock = prefix, every_s, time.monotonic
        self._last = self._clock()
        self.phases: Phases | None = None

    def say(self, text: str) -> None:
        import sys

        print(f"{self.prefix}: {text}", file=sys.stderr, flush=True)
        self._last = self._clock()

    def phase(self, name: str) -> None:
        self.say(f"measured step, {name}")

    def watch(self, model: nn.Module | None, what: str) -> list[Any]:
        """Forward pre-hooks on every decoder layer of `model` (its `layers` lists); returns their handles."""
        if model is None:
            return []
        lists = [m for name, m in model.named_modules() if name.endswith("layers") and isinstance(m, nn.ModuleList)]
        handles = []
        for layers in lists[:1]:
            n = len(layers)
            for i, layer in enumerate(layers):
                handles.append(layer.register_forward_pre_hook(functools.partial(self._layer, what, i, n)))
        return handles

    def _layer(self, what: str, i: int, n: int, *_: Any) -> None:
        if self.phases is not None and self._clock() - self._last >= self.every_s:
            self.say(f"measured step, {self.phases.stack[-1]}: {what} layer {i + 1}/{n}")


def check_estimate_tokens(tokens: list[int], flag: str = "--tokens") -> None:
    """Refuse rows the estimate cannot finish (BadArgument naming the flag): see MAX_ESTIMATE_TOKENS."""
    from hylo.pipeline.cli import BadArgument

    given = ",".join(map(str, tokens))
    for t in tokens:
        if t > MAX_ESTIMATE_TOKENS:
            raise BadArgument(
                f"{flag}={given}: {t:,} tokens is more than the estimate can run, at most {MAX_ESTIMATE_TOKENS:,} "
                f"(2^20) a row: the step runs on fake tensors at about 3-4 ms of CPU per token (a 128K row of the 3B "
                f"recipe: 8.5 min), so 2^20 tokens already take about an hour, and the row is a real host tensor")
    if sum(tokens) > MAX_ESTIMATE_TOTAL:
        raise BadArgument(f"{flag}={given}: {sum(tokens):,} tokens in all is more than the estimate can run in one call, "
                          f"at most {MAX_ESTIMATE_TOTAL:,} (2 x 2^20; about 3-4 ms of CPU per token): split the lengths "
                          f"over several calls")


def estimate_step(cfg: StageConfig, tokens: int, world_size: int | None = None, dtype: torch.dtype = torch.bfloat16,
                  gpu: bool = True, shapes: Shapes | None = None, stage1: Stage1Config | None = None,
                  doc_tokens: tuple[int, int] = DOC_TOKENS, count_flops: bool = True,
                  variant: Callable[..., Any] | None = None, other_worlds: tuple[int, ...] = (),
                  progress: Progress | None = None, sequence_parallel: int = 1) -> Estimate:
    """Memory per GPU and FLOPs of one step of `cfg`'s stage on rows of `tokens` tokens (see the module
    docstring). `world_size`: the ZeRO-3 world (default: the config's ray.num_workers). `gpu`: the
    accelerator's rules (deferred checks, its chunk size); False runs the CPU path as a CPU step runs it.
    `variant(task, frozen_model) -> (task, frozen_model)`: changes the built task (the paper's comparison
    forms, bench only). `other_worlds`: also the per-GPU peak at these world sizes (`Estimate.peaks_by_world`).
    `progress`: where its progress lines go (None: none)."""
    import time

    from hylo.kernels.fused_kl.inputs import deferred_checks
    from hylo.pipeline.train import stage1 as stage1_mod
    from hylo.pipeline.train import stage2 as stage2_mod

    t0 = time.perf_counter()
    W = world_size or cfg.ray.num_workers
    shapes = shapes or shapes_of(cfg, stage1)
    vocab = shapes.student.vocab_size
    if isinstance(cfg, Stage2Config) and gpu and cfg.kd.chunk_size is None:
        cfg = dataclasses.replace(cfg, kd=dataclasses.replace(cfg.kd, chunk_size=gpu_chunk_size(tokens, vocab)))
    N = sequence_parallel
    warm = min(256, tokens) // N * N
    warm_row = synthetic_row(warm, vocab, (min(64, warm), min(128, warm)), seed=1)
    row = synthetic_row(tokens, vocab, doc_tokens)
    stage = 1 if isinstance(cfg, Stage1Config) else 2
    step = stage1_mod.train_step if stage == 1 else stage2_mod.train_step
    rules = deferred_checks() if gpu else contextlib.nullcontext()
    # sequence parallelism: the LAST rank of a group of N on torch's fake process group (estimate_sp.split_rank)
    split = contextlib.nullcontext()
    if N > 1:
        import torch.distributed as dist

        from hylo.pipeline.train.fake_group import split_rank

        if dist.is_available() and dist.is_initialized():
            raise EstimateError("the split step runs on a fake process group, and this process has a process group")

        split = split_rank(N)
    with split, fake_tensors() as host, rules:
        memory = StepMemory(W, host)
        memory.other_worlds = tuple(other_worlds)
        build = build_stage1 if stage == 1 else build_stage2
        if progress is not None:
            progress.say("building the models")
        task, frozen = build(cfg, shapes, dtype, gpu)
        if variant is not None:
            task, frozen = variant(task, frozen)
        ctx = _Solo(cfg=cfg, rank=N - 1, world_size=N, device=torch.device("cpu"), dtype=dtype, run_dir=Path("."),
                    grad_accum=1, sp_group=None, sp_rank=N - 1, sp_size=N, dp_rank=0, dp_size=1)
        engine: TrackedEngine = task.engine
        if progress is not None:
            progress.say(f"warm-up step ({warm_row.num_tokens} tokens)")
        step(task, [warm_row], ctx)
        student_params = [p for p in engine.params]
        masters = [m for p, m in zip(engine.params, engine.masters) if m is not p]
        p_bytes, m_bytes = _state_bytes(student_params), _state_bytes(masters)
        o_bytes = _state_bytes(_optimizer_tensors(engine.optimizer))
        frozen_params = list(frozen.parameters()) if frozen is not None else []
        f_bytes = _state_bytes(frozen_params)
        memory.sharded_static = p_bytes + m_bytes + o_bytes
        host.flop_registry = flop_registry() if count_flops else None
        phases = Phases(host, memory, progress)
        engine.phases = phases
        hooks = []
        if progress is not None:
            progress.phases = phases
            hooks = progress.watch(task.student, "student") + progress.watch(frozen, "base" if stage == 1 else "teacher")
        if stage == 2:
            task.teacher.source = _MarkedSource(task.teacher.source, phases)
        host.reads.clear()
        host.gemms.clear()
        tracker = memory.tracker
        tracker.track_external(task.engine.module, engine.optimizer, *masters, *frozen_params)
        with tracker, _loss_marked(phases):
            memory.phase, memory.active = "forward/backward", True
            memory.peak = 0.0
            base_total = memory.total()
            start = base_total - memory.sharded_static + memory.sharded_static / W
            phases._account()
            step(task, [row], ctx)
            phases._account()
            memory.active = False
        for h in hooks:
            h.remove()
        if progress is not None:
            progress.say(f"done in {time.perf_counter() - t0:.0f} s")
    at = memory.at_peak
    W_shard = W
    grads = at.get("gradients", 0) / W_shard
    other = at.get("total", 0) - memory.sharded_static - at.get("gradients", 0) - f_bytes
    opt_temps = 0.0
    if at.get("phase") == "optimizer":
        floor = memory.step_floor or 0.0
        opt_temps = (at["total"] - floor - memory.sharded_static - at.get("gradients", 0)) / W_shard
        other = floor - f_bytes
    mem = {"parameters": p_bytes / W, "gradients": grads, "optimizer states (fp32 master + AdamW)": (m_bytes + o_bytes) / W,
           "optimizer step temporaries": opt_temps, "activations, temporaries, loss buffers": other,
           "frozen model" if stage == 1 else "teacher weights": f_bytes}
    el = next(iter(engine.params)).element_size()
    n = sum(p.numel() for p in engine.params)

    def zero3(world: int) -> float:
        if world == 1:
            return 0.0
        return min(n, ZERO3_MAX_LIVE_PARAMETERS) * el * (1 - 1 / world) + cfg.deepspeed.reduce_bucket_size * el

    zero = zero3(W)
    if zero:
        mem["ZeRO-3 gathered parameters + reduce bucket"] = zero
    peak = memory.peak + zero
    by_world = {w: v + zero3(w) for w, v in memory.other_peaks.items()}
    by_world[W] = peak
    flops = {k: v for k, v in phases.flops.items() if v}
    n_params = sum(p.numel() for p in task.student.parameters())
    return Estimate(stage=stage, tokens=tokens, world_size=W, dtype=str(dtype).removeprefix("torch."),
                    parameters=n_params, trainable_parameters=sum(p.numel() for p in engine.params), memory=mem,
                    peak_bytes=peak, peak_phase=str(at.get("phase")), loss_chunk_bytes=max(phases.loss_peaks, default=0.0),
                    flops=flops, host_reads=sorted(set(host.reads)), start_bytes=start + zero, peaks_by_world=by_world,
                    phase_peaks={k: v + zero for k, v in memory.phase_peaks.items()},
                    gemms=sorted(((op, shp, c, f) for (op, shp), (c, f) in host.gemms.items()), key=lambda g: -g[3]),
                    teacher_parameters=sum(p.numel() for p in frozen_params), seconds=time.perf_counter() - t0)


def estimate_teacher_replica(cfg: Stage2Config, tokens: int, shapes: Shapes | None = None,
                             doc_tokens: tuple[int, int] = DOC_TOKENS) -> Estimate:
    """One GPU of the teacher pool (`teacher.source: serve`): its `TeacherModel` over one batch of rows
    (as many rows of `tokens` as `teacher.pool.max_batch_tokens` holds, at least one), giving top-k records
    (`teacher.k` > 0) or the logit chunks of one row's stream. Weights and the forward's peak."""
    import time

    from hylo.pipeline.teacher.model import TeacherModel, torch_dtype

    t0 = time.perf_counter()
    shapes = shapes or shapes_of(cfg)
    t = cfg.teacher
    vocab = shapes.teacher.vocab_size
    n_rows = max(1, t.pool.max_batch_tokens // tokens)
    rows = [synthetic_row(tokens, vocab, doc_tokens, seed=i) for i in range(n_rows)]
    memory = StepMemory(1)
    with fake_tensors() as host:
        memory.host = host
        model = _build_model(shapes.teacher, torch_dtype(t.model.dtype))
        m = t.model
        teacher = TeacherModel(model, dtype=m.dtype, device="cpu", isolation=m.isolation,
                               logits_chunk_tokens=m.logits_chunk_tokens, max_forward_tokens=m.max_forward_tokens)
        params = list(model.parameters())
        w_bytes = _state_bytes(params)
        host.flop_registry = flop_registry()
        phases = Phases(host, memory)
        memory.tracker.track_external(*params)
        with memory.tracker:
            memory.phase, memory.active = "teacher forward", True
            base = memory.total()
            with phases.phase("teacher forward"):
                if t.k > 0:
                    teacher.topk_batch(rows, t.k, t.client.dtype)
                else:
                    hidden = teacher.hidden_batch(rows[:1])[0]
                    for _ in teacher.logits_chunks(hidden):
                        pass
            memory.active = False
    return Estimate(stage=2, tokens=tokens, world_size=1, dtype=t.model.dtype, parameters=sum(p.numel() for p in params),
                    trainable_parameters=0,
                    memory={"teacher weights": w_bytes, "activations, temporaries, loss buffers": memory.peak - w_bytes},
                    peak_bytes=memory.peak, peak_phase="teacher forward", loss_chunk_bytes=0.0,
                    flops={k: v // n_rows for k, v in phases.flops.items() if v}, host_reads=sorted(set(host.reads)),
                    start_bytes=float(base), teacher_parameters=sum(p.numel() for p in params),
                    seconds=time.perf_counter() - t0,
                    notes=[f"a batch of {n_rows} row(s) of {tokens} tokens (teacher.pool.max_batch_tokens "
                           f"{t.pool.max_batch_tokens})"])


# ------------------------------------------------------------------------------------ report
def _gib(x: float) -> str:
    return f"{x / GIB:.1f}" if x >= 0.05 * GIB or x == 0 else f"{x / GIB:.2f}"


def _k(tokens: int) -> str:
    return f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def per_key_lines(keys: list[str], ests: list[Any], value: Callable[[Any, str], float], label_width: int,
                  w: int) -> list[str]:
    """One table line per key: the key, then `value(estimate, key)` of each estimate (one decimal)."""
    return [f"  {k:<{label_width}}" + "".join(f"{value(e, k):>{w}.1f}" for e in ests) for k in keys]


def format_table(title: str, ests: list[Estimate]) -> str:
    """One column per length: the memory rows per GPU, the peak, which GPUs it fits, FLOPs and times."""
    cols = [_k(e.tokens) for e in ests]
    w = max(9, *(len(c) + 2 for c in cols))
    keys: list[str] = []
    for e in ests:
        keys += [k for k in e.memory if k not in keys]
    lines = [title, f"{'per GPU (GiB)':<44}" + "".join(f"{c:>{w}}" for c in cols)]
    for k in keys:
        vals = [e.memory.get(k, 0.0) for e in ests]
        if not any(vals):
            continue
        lines.append(f"  {k:<42}" + "".join(f"{_gib(v):>{w}}" for v in vals))
    if any(e.loss_chunk_bytes for e in ests):
        lines.append(f"  {'  of which the fused loss (its own peak)':<42}"
                     + "".join(f"{_gib(e.loss_chunk_bytes):>{w}}" for e in ests))
    lines.append(f"{'peak':<44}" + "".join(f"{_gib(e.peak_bytes):>{w}}" for e in ests))
    short = {"forward/backward": "fwd/bwd", "optimizer": "optimizer", "teacher forward": "forward"}
    lines.append(f"{'  reached in':<44}" + "".join(f"{short.get(e.peak_phase, e.peak_phase):>{w}}" for e in ests))
    lines.append(f"fits (peak <= {1 - FIT_MARGIN:.0%} of the memory):")
    for g in GPUS:
        lines.append(f"  {g.name + f' {g.memory_gib:.0f} GiB':<42}"
                     + "".join(f"{('yes' if g.fits(e.peak_bytes) else 'no'):>{w}}" for e in ests))
    phases: list[str] = []
    for e in ests:
        phases += [k for k in e.flops if k not in phases]
    lines.append(f"{'FLOPs per row (TFLOP; a step is grad_accum rows)':<44}")
    lines += per_key_lines(phases, ests, lambda e, k: e.flops.get(k, 0) / 1e12, 42, w)
    lines.append(f"  {'total':<42}" + "".join(f"{e.total_flops / 1e12:>{w}.1f}" for e in ests))
    lines.append("time at the dense bf16 peak (s, a lower bound):")
    for g in GPUS:
        lines.append(f"  {g.name + f' {g.bf16_tflops:.0f} TFLOP/s':<42}"
                     + "".join(f"{g.seconds(e.total_flops):>{w}.2f}" for e in ests))
    return "\n".join(lines)


def estimate_call(setup: Callable[[], Any], run: Callable[[Any], Any], gpu: bool = True) -> float:
    """Peak bytes `run(setup())` allocates beyond what `setup()` made (inputs, modules, their states): the
    estimate of one measured call, for bench/gpu_check.py. Both run on fake CPU tensors, on the torch kernel
    paths (`HYLO_KERNELS=torch`'s), under the accelerator's rules of the fused KL when `gpu`."""
    from torch.utils._pytree import tree_leaves

    from hylo.kernels.backend import forced_mode
    from hylo.kernels.fused_kl.inputs import deferred_checks

    rules = deferred_checks() if gpu else contextlib.nullcontext()
    with fake_tensors() as host, forced_mode("torch"), rules:
        state = setup()
        memory = StepMemory(1, host)
        tracked = [x for x in tree_leaves(state, is_leaf=lambda x: isinstance(x, nn.Module))
                   if isinstance(x, torch.Tensor | nn.Module)]
        memory.tracker.track_external(*tracked)
        with memory.tracker:
            memory.phase, memory.active = "call", True
            base = memory.total()
            memory.peak = float(base)
            run(state)
            memory.active = False
    return memory.peak - base
