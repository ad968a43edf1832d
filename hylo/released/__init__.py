"""Import and export of the released checkpoint layout (AMD's Hybrid-Models code, the HyLo / Zebra-Llama cards).

A released checkpoint directory holds:
* `config.json`: the base model's config, copied as it was; the vocabulary, bos/eos/pad ids, the MLP
  activation and bias come from here (AMD's hybrid config has no such keys). Its `tie_word_embeddings` does
  not tie anything there: AMD's `CustomLlamaForCausalLM` replaces the inner model after the head was tied,
  so `lm_head.weight` is always stored and always used as it is;
* `hybrid_config.json`: `asdict` of AMD's `HybridConfig` dataclass (every field written, read back as
  `HybridConfig(**json)`: a missing key takes its default, an unknown one is a TypeError; the fields, defaults
  and asserts of the public version are in hylo/released_facts.py with the commit they were read at):
  `n_layer`, `mla_layers`, the MLA shapes (`kv_lora_rank`, `q_lora_rank`, `qk_*_head_dim`, `v_head_dim`,
  `use_lora_layer_norm`, `use_full_kv_head`, ...), RoPE (`rope_theta`, `rope_scaling`), the Mamba-2 shapes
  (`d_model`, `d_inner`, `d_xb`, `ssm_cfg`); older versions also wrote `layer_rank_list` and three more (read
  here, never written), and HyLo's own layouts add `linear_type`, `gdn_num_heads`, `gdn_head_dim` (GDN) and
  our `use_qk_norm` (Qwen q/k norms), which the public dataclass refuses;
* safetensors whose keys are those of a Llama causal LM whose layers hold their mixer under `mla.`
  (`q_a_proj`, `q_a_layernorm`, `q_b_proj` or `q_proj`, `kv_a_proj_with_mqa`, `kv_a_layernorm`,
  `kv_b_proj`, `out_proj`, and on Qwen HyLo models per-head `q_norm` / `k_norm`), `gdn.` with
  flash-linear-attention's names (the same as ours), or `mamba.` (Zebra-Llama's Mamba-2: `in_proj` rows
  `[z | x | B | C | dt]`, `conv1d`, `dt_bias`, `A_log`, `D`, `norm`, `out_proj`).

How it differs from ours, and why each mapping is exact:
* names: `mixer.*` here, `mla.*` / `gdn.*` / `mamba.*` there; `o_proj` here, `out_proj` there.
* `kv_b_proj`: there one block of (nope-key, value) rows per KV head, each query head reading its
  group's block (`repeat_kv`), unless `use_full_kv_head` (one block per query head). Ours supports both
  natively (`kv_b_per_kv_head`), so an import copies the rows as they are. An export writes per KV head
  when our per-query-head rows repeat within each group, and `use_full_kv_head: true` otherwise.
* RoPE: DeepSeek / AMD rotate interleaved pairs (dims 2i, 2i+1), we rotate halves (dims i, i + P/2).
  Pair i turns at the same frequency in both, so permuting the rope rows of the query heads and of the
  shared key (`k_pe`), and the rope part of the q/k norm weights, maps one onto the other exactly. Both
  codes turn pair i at `rope_theta ** (-2i / P)` with the theta of hybrid_config.json (AMD's MLA reads
  `HybridConfig.rope_theta`, not config.json's): our converter's theta (the base's `theta ** (P / head_dim)`,
  which keeps the base's highest-frequency pairs) is written there as it is, and a released model's theta
  (the base's own, applied to P dims) is imported as it is, so positions match both ways.
* The latent RMSNorms (`use_lora_layer_norm`) use eps 1e-6 there: imported as `mla_latent_norm_eps`.
* YaRN: the same frequencies and softmax scale; the cos/sin magnitude is `mscale(factor, mscale) /
  mscale(factor, mscale_all_dim)` there, written as an explicit `attention_factor` on import.
* Mamba-2 (AMD's variant of mamba_ssm's layer): `nheads = ngroups`, `headdim = d_state`, C per head,
  x and B projected for `d_xb / d_state` groups and repeated to the heads after the conv (GQA's rule), the
  gated norm per head with eps 1e-5. Ours holds that natively (`mamba2_xb_groups`, `mamba2_n_groups =
  heads`, `mamba2_norm_eps`); `repeat_kv_before_conv: true` (conv over the repeated channels) imports
  exactly as x/B rows repeated per head.

GDN dimensions are read from the tensors' shapes and checked against `gdn_*` keys where present. Nothing
is unpickled: a directory with only `pytorch_model.bin` is refused. `check_released_dir` reads a written
directory back the way AMD's public loader does (its fields, defaults and asserts at the pinned commit, then
the module tree their code builds, tensor names matched one by one as `load_state_dict(strict=False)` would)
and names every tensor that would be dropped, left at its random init, or refused for its shape; the export
runs it on its own output. X-EcoMLA's layout (MLA_config.json + mla_layer_config.json) is
hylo/released_xecomla.py (which builds on this package; `hylo.io.load_hylo` and the convert job pick the
layout); bench/amd_compat.py checks both against AMD's real code.

The modules, in the order an import reads them: `layout.py` (the keys, the error, detection, tensor names,
RoPE rows), `reading.py` (the tensors and our HybridConfig), `importing.py` (our state dict, the loaded
model), `readback.py` (what AMD's loader would read), `export.py` (the files written, atomically, read back).
Outside callers import from here.
"""

from hylo.released.export import export_released
from hylo.released.importing import load_released
from hylo.released.layout import ReleasedLayoutError, is_released_layout
from hylo.released.readback import check_released_dir, public_loader_refusal, their_expected_tensors
from hylo.released.reading import released_hybrid_config

__all__ = [
    "ReleasedLayoutError",
    "check_released_dir",
    "export_released",
    "is_released_layout",
    "load_released",
    "public_loader_refusal",
    "released_hybrid_config",
    "their_expected_tensors",
]
