"""Memory and FLOPs of ONE training step at any shape, without the hardware: the step run on fake tensors.

    hylo estimate --config configs/llama-3.2-1b-8mla8gdn-64k.yaml                  # stage 2 at its seq_len
    hylo estimate --config configs/llama-3.2-1b-8mla8gdn-64k.yaml --tokens 8192,32768,65536,131072
    hylo estimate --config configs/demo-smollm2.yaml --stage 1 --world-size 1
    hylo estimate --config configs/llama-3.2-3b-14mla14gdn-64k.yaml --tokens 131072 --sequence-parallel 4

With `--sequence-parallel N` (one row split by tokens over N GPUs) the step below runs at T / N tokens, the
rank's share, and `sp.py` adds what splitting adds and the bytes each layer sends; `sp_teacher.py` prices the
teacher per GPU run whole (today) and split (`train.sequence_parallel_teacher`, `--teacher-split`).

Legend: T tokens of a packed row, W training workers (GPUs, the ZeRO-3 world size), P student parameters.

What runs: the trainer's own step, `pipeline/train/loop.train_step` with the stage's task, on the
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
  counts it: dense within each SDPA call (causal kernels do about half of it). Each op's FLOPs also
  carry the dtype class it runs at on a GPU (`flops.py`: bf16 / fp16 tensor cores, tf32, fp32 vector units;
  the narrowest floating dtype of its inputs, so a bf16 x bf16 -> fp32 `out_dtype` product is bf16; the
  torch GDN / SSD scans, which compute in fp32, count at their inputs' dtype as fla's kernels multiply).
  Time at a GPU is each class's FLOPs over that class's dense peak (`gpus.py`, from the data sheets): a
  LOWER BOUND on the step time (no kernel reaches its peak, memory-bound ops and communication are not
  counted).
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
* Kernels: fake tensors are CPU tensors, so the torch paths run (the fused KL's torch chunk step; SDPA takes
  its flash path, O(T) memory). `gpu=True` (the default) gives the step the accelerator's rules where they
  change memory: the fused KL's deferred checks (every row through the chunks, masked ones zeroed), its chunk
  size as a GPU picks it (`auto_chunk_size` for a GPU), and the GDN / Mamba-2 scans as fla runs them
  (`fake_tensors(gpu=True)`: fla's two chunk functions are priced by `hylo.kernels.fla_shapes`, which
  allocates and saves what fla's autograd functions allocate and save, checked against fla under Triton's
  interpreter, and counts their products' FLOPs). `gpu=False` (`--cpu`) runs our torch scans, which keep
  every chunk's intermediates for autograd, as a CPU step does.

The package, along the estimate's parts (each module's docstring says more):
* `gpus.py`: the GPUs the figures are compared with (memory, dense bf16 / tf32 / fp32 peaks, cited);
* `flops.py`: the dtype class each counted FLOP runs at;
* `shapes.py`: the models' shapes (the student, the base, the teacher) and the teacher at its shape;
* `fake.py`: the fake tensors the step runs on, the host values it reads, the FLOP formulas;
* `tracking.py`: memory and FLOPs over the step (MemTracker, the phases, the engine that marks them), progress;
* `step.py`: the estimate of one step (`estimate_step`), of a teacher replica, of one measured call;
* `report.py`: the table `hylo estimate` prints;
* `sp.py`: what sequence parallelism adds; `sp_teacher.py`: the teacher (stage 1: the base) per GPU, run whole
  against split with the row, and the bytes of each scheme; `fake_group.py`: this process as a rank of torch's fake process
  group; `cli.py`: `hylo estimate`'s command line; `args.py`: its flags and config, without torch (the job
  parses with it first, so `--help` and `--print-config` answer at once).
The step itself is the stage's own: `stage1.build` / `stage2.build` with factories of models of the config's
shapes, `PlainEngine` (marked, `TrackedEngine`) and the teacher at its shape, then `train_step`.
"""

from __future__ import annotations

from hylo.lazy import lazy_exports

# The names below are loaded on first use: `hylo estimate --help` (args.py) imports no torch.
_EXPORTS = {
    "fake": ("EstimateError", "build_model", "cast_parameters", "fake_like", "fake_tensors", "flop_registry"),
    "flops": ("dtype_class",),
    "gpus": ("GPU", "GPUS"),
    "report": ("format_table",),
    "shapes": ("Shapes", "ShapeTeacher", "model_config", "parameter_count", "shapes_of", "student_config"),
    "step": ("DOC_TOKENS", "Estimate", "estimate_call", "estimate_step", "estimate_teacher_replica", "synthetic_row"),
    "tracking": ("Progress",),
}
__getattr__, __dir__, __all__ = lazy_exports(__name__, _EXPORTS)
