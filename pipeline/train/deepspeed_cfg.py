"""The DeepSpeed config, generated from ours (never hand-written), and the engine.

Design choices:
* One packed row per micro-batch: packing already fills the context. Gradient accumulation alone reaches
  the global batch (`StageConfig.grad_accum`).
* DeepSpeed knows nothing of sequence-parallel groups. It sees W ranks of G micro-batches, averages
  gradients over all W and shards ZeRO-3 over all W. So checkpoints do not depend on N.
* The optimiser is a client `torch.optim.AdamW`. One in the DeepSpeed config would compile DeepSpeed's CPU
  Adam for nothing.
* bf16 with fp32 master weights on GPU, plain fp32 on CPU (`resolve_dtype`).
* Clipping is DeepSpeed's, so the norm it reports is the one it clipped with.
* `import_deepspeed` keeps DeepSpeed from compiling an op and a Muon optimiser that training never uses.
* ZeRO-3 with `train.compile: blocks`: each decoder block is a ZeRO-3 leaf module (`leaf_blocks`).
"""

from __future__ import annotations

import functools
import importlib
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from hylo import logs
from hylo.pipeline.config import ConfigError
from hylo.pipeline.train.config import DeepSpeedSection, StageConfig

logger = logs.get_logger(__name__)

# DeepSpeed's name for its CPU shared-memory all-reduce op (ShareMemCommBuilder.NAME, deepspeed/ops/op_builder/cpu)
SHM_COMM_OP = "deepspeed_shm_comm"
# DeepSpeed's Muon optimiser, which its ZeRO code imports in every engine (import_deepspeed)
MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def import_deepspeed():
    """`deepspeed`, with its CPU shared-memory all-reduce op (`SHM_COMM_OP`) marked unavailable, so that it is
    never built.

    On its CPU accelerator, DeepSpeed's torch backend compiles that C++ op with ninja whenever it starts
    (`deepspeed.init_distributed`, or `deepspeed.initialize` inside a process group Ray Train made): 54 CPU-seconds
    on the 2-core build machine, again for every Python environment (the build records the environment's paths,
    so a second virtualenv sharing TORCH_EXTENSIONS_DIR builds it anew), behind a lock that a process killed
    mid-build leaves to block the next (`loop.watch_stale_build_locks`). Only `inference_all_reduce` uses the op;
    training's collectives go through the process group (gloo on CPU) either way. DeepSpeed asks its table of
    compatible ops first (`deepspeed.ops.__compatible_ops__`, probed once a process and kept, edits included):
    the op is marked unavailable there, and a DeepSpeed without that table is left as it is. On a GPU the op is
    never built, so nothing changes there.

    Also, DeepSpeed's Muon optimiser (`MUON_MODULE`) is imported with its `torch.compile` deferred to its first
    call. DeepSpeed's ZeRO code imports that module in every engine (to ask whether the optimiser is a Muon), and
    the module `torch.compile`-decorates three functions when it loads, which imports TorchDynamo and Inductor:
    2.7 CPU-seconds (13 s of wall time on the loaded build machine) in every training process, for an optimiser
    training never uses (ours is a client AdamW). The module and its class are DeepSpeed's own; a function of
    it is compiled when first called, as `torch.compile` would compile it then. A Muon already loaded is left
    as it is."""
    import deepspeed  # lazy: deepspeed
    import deepspeed.ops  # lazy: deepspeed

    ops = getattr(deepspeed.ops, "__compatible_ops__", None)
    if isinstance(ops, dict):
        ops[SHM_COMM_OP] = False
    _import_muon_with_lazy_compile()
    logs.set_library_levels()  # DeepSpeed's logger (`deepspeed.utils.logger`) at the job's level
    return deepspeed


def _import_muon_with_lazy_compile() -> None:
    """Import `MUON_MODULE` while DeepSpeed's `compiler.compile()` decorator defers `torch.compile` to the first
    call of the function it decorates (import_deepspeed)."""
    if MUON_MODULE in sys.modules:
        return
    try:
        from deepspeed.runtime import compiler  # lazy: deepspeed
    except ImportError:
        return
    real = getattr(compiler, "compile", None)
    if real is None:
        return

    def lazy_compile(*args: Any, **kwargs: Any) -> Callable[[Callable], Callable]:
        def decorate(fn: Callable) -> Callable:
            compiled: list[Callable] = []

            @functools.wraps(fn)
            def call(*a: Any, **k: Any) -> Any:
                if not compiled:
                    compiled.append(real(*args, **kwargs)(fn))
                return compiled[0](*a, **k)

            return call

        return decorate

    compiler.compile = lazy_compile
    try:
        importlib.import_module(MUON_MODULE)
    except ImportError:  # a DeepSpeed without Muon
        pass
    finally:
        compiler.compile = real


def resolve_dtype(name: str, use_gpu: bool) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if use_gpu else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def zero_section(ds: DeepSpeedSection) -> dict[str, Any]:
    z: dict[str, Any] = {"stage": ds.zero_stage}
    if ds.zero_stage == 0:
        return z
    z.update(overlap_comm=ds.overlap_comm, reduce_bucket_size=ds.reduce_bucket_size, contiguous_gradients=True)
    if ds.offload_optimizer != "none":
        z["offload_optimizer"] = {"device": ds.offload_optimizer, "pin_memory": torch.cuda.is_available()}
    if ds.zero_stage == 3:
        z.update(
            stage3_prefetch_bucket_size=ds.stage3_prefetch_bucket_size,
            stage3_param_persistence_threshold=ds.stage3_param_persistence_threshold,
            # Consolidation at the end gathers parameters itself (one module at a time).
            stage3_gather_16bit_weights_on_model_save=False,
        )
        # (offload_param with another stage is refused when the config loads: DeepSpeedSection)
        if ds.offload_param != "none":
            z["offload_param"] = {"device": ds.offload_param, "pin_memory": torch.cuda.is_available()}
    return z


def build_deepspeed_config(cfg: StageConfig, world_size: int, dtype: torch.dtype) -> dict[str, Any]:
    """DeepSpeed config dict for `cfg` on `world_size` ranks training in `dtype`."""
    return {
        # DeepSpeed's identity: micro-batch (1) x accumulation x ranks (= train.global_batch_sequences x
        # train.sequence_parallel: a split row is a micro-batch on each of its group's ranks).
        "train_batch_size": cfg.grad_accum * world_size,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": cfg.grad_accum,
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": zero_section(cfg.deepspeed),
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": False},
        # DeepSpeed's own periodic prints and wall-clock breakdown stay off: metrics.py reports.
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }


def init_engine(module: torch.nn.Module, params: list[torch.nn.Parameter], cfg: StageConfig, world_size: int,
                dtype: torch.dtype, lr_lambda):
    """`deepspeed.initialize` with a client AdamW over `params` and a LambdaLR schedule."""
    deepspeed = import_deepspeed()
    if not params:
        raise ConfigError("no trainable parameters: check which modules this stage trains")
    o = cfg.optim
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    if cfg.deepspeed.zero_stage == 3 and cfg.train.compile == "blocks":
        leaf_blocks(deepspeed, module)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=scheduler,
                                           config=build_deepspeed_config(cfg, world_size, dtype))
    return engine


def leaf_blocks(deepspeed: Any, module: torch.nn.Module) -> int:
    """Make every HyLo decoder block in `module` a ZeRO-3 leaf module (`deepspeed.utils.set_z3_leaf_modules`),
    before `deepspeed.initialize` registers its hooks; returns how many.

    ZeRO-3 then hooks the block, not the modules inside it. The block's pre-forward hook gathers all its
    parameters at once and its post-forward hook releases them (the backward hooks likewise). Both run in the
    block's `__call__`, around its `forward`, which is the compiled function (pipeline/train/compile.py). So no
    ZeRO-3 hook runs inside a graph: dynamo never traces DeepSpeed's code, and the rows of any layout reuse the
    first row's graphs as without ZeRO-3. Without it, the hooks of the norms, projections and MLP inside a
    block run inside its graph, and dynamo compiles DeepSpeed's hook code again for each module until its
    recompile limit. The cost: one block's parameters are gathered whole (ZeRO-3's prefetch gathers ahead
    anyway). docs/cold-start.md#compiled-blocks."""
    from hylo.modeling import HyLoDecoderLayer  # lazy: the model code

    leaves = deepspeed.utils.set_z3_leaf_modules(module, [HyLoDecoderLayer])
    logger.info(f"[compile] ZeRO-3: {len(leaves)} decoder blocks are leaf modules (each "
                "gathered whole around its compiled forward)")
    return len(leaves)


# (module, its trainable parameters) -> the engine a stage's step calls: DeepSpeed's (`deepspeed_engine`) in the
# trainer, `plain_engine.plain_engine`'s elsewhere (stage1.build / stage2.build take one)
EngineFactory = Callable[[torch.nn.Module, list[torch.nn.Parameter]], Any]


def deepspeed_engine(ctx: Any, lr_lambda: Callable[[int], float] | None) -> EngineFactory:
    """The trainer's engine factory: `init_engine` over ctx.world_size in ctx.dtype with the schedule `lr_lambda`
    (`ctx`: the stage's WorkerContext)."""
    if lr_lambda is None:
        raise ValueError("DeepSpeed's engine needs the learning-rate schedule (lr_lambda)")

    def make(module: torch.nn.Module, params: list[torch.nn.Parameter]):
        t0 = time.time()
        engine = init_engine(module, params, ctx.cfg, ctx.world_size, ctx.dtype, lr_lambda)
        clock = getattr(ctx, "startup", None)  # the trainer's start-up clock (train/startup.py)
        if clock is not None:
            clock.add("deepspeed init", time.time() - t0)
        return engine

    return make


def current_lr(engine) -> float:
    return float(engine.optimizer.param_groups[0]["lr"])
