"""vLLM's `hylo` plugin (entry point `vllm.general_plugins`): what vLLM needs to find and size a HyLo model.

vLLM calls `register()` in every process it starts (API server, engine core, workers), so every step is
idempotent. Each registration uses a registry vLLM keeps for the purpose:

* the model class: `ModelRegistry.register_model("HyLoForCausalLM", ...)` (loaded lazily, by name);
* our config class for `model_type: hylo` (transformers' `AutoConfig.register`), so no remote code runs;
* a config format `hylo` (`--config-format hylo`, `vllm.transformers_utils.config.register_config_parser`)
  that also reads AMD's released layout (a Llama `config.json` beside `hybrid_config.json`);
* an architecture convertor for `model_type: hylo` (`MODEL_ARCH_CONFIG_CONVERTORS`): MLA with one latent
  "head" of the served width, which sizes the KV cache (vLLM decides MLA from a list of model types).

vLLM's CPU limits that stand between a user and a working server are handled in `hylo.serving.vllm_compat`,
one place, version-guarded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

MODEL_CLASS = "hylo.serving.vllm_model:HyLoForCausalLM"
CONFIG_FORMAT = "hylo"


def register() -> None:
    from vllm import ModelRegistry

    from hylo.serving import vllm_compat

    if "HyLoForCausalLM" not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model("HyLoForCausalLM", MODEL_CLASS)
    _register_config()
    _register_config_format()
    _register_arch_convertor()
    vllm_compat.apply()


def _register_config() -> None:
    from transformers import AutoConfig

    from hylo.config import HybridConfig

    AutoConfig.register("hylo", HybridConfig, exist_ok=True)


def hylo_config(model: str | Path) -> Any:
    """The HybridConfig of an export or of a released checkpoint (read as `hylo.released` imports it)."""
    from hylo.config import HybridConfig
    from hylo.released.layout import is_released_layout
    from hylo.released.reading import released_hybrid_config

    path = Path(model)
    if path.is_dir() and is_released_layout(path):
        cfg = released_hybrid_config(path)
    else:
        cfg = HybridConfig.from_pretrained(str(path))
    cfg.architectures = ["HyLoForCausalLM"]
    return cfg


def _register_config_format() -> None:
    from vllm.transformers_utils.config import register_config_parser
    from vllm.transformers_utils.config_parser_base import ConfigParserBase

    class HyLoConfigParser(ConfigParserBase):
        def parse(self, model: str | Path, trust_remote_code: bool, revision: str | None = None,
                  code_revision: str | None = None, **kwargs: Any) -> tuple[dict, Any]:
            cfg = hylo_config(model)
            return cfg.to_dict(), cfg

    register_config_parser(CONFIG_FORMAT)(HyLoConfigParser)


def _register_arch_convertor() -> None:
    from vllm.transformers_utils.model_arch_config_convertor import (
        MODEL_ARCH_CONFIG_CONVERTORS,
        ModelArchConfigConvertorBase,
    )

    from hylo.serving.widths import served_widths

    class HyLoArchConvertor(ModelArchConfigConvertorBase):
        def is_deepseek_mla(self) -> bool:
            return True

        def get_head_size(self) -> int:
            return served_widths(self.hf_text_config).served_width

        def get_total_num_kv_heads(self) -> int:
            return 1

    MODEL_ARCH_CONFIG_CONVERTORS["hylo"] = HyLoArchConvertor
