"""HyLoCache: the generation cache of a hybrid model.

Legend: B batch, T cached tokens, R kv_lora_rank, P qk_rope_head_dim, H heads, K/V GDN key/value
head dims, C conv channels, W conv_size - 1.

* MLA layer: `c_kv_BTR` (the RMS-normalised latent) and `k_pe_BTP` (the roped shared key). Nothing
  else: the decode path absorbs `W_kvb` into the query, so full K/V are never stored.
* Linear layer (GDN / Mamba-2): a recurrent state (`state_BHKV` for GDN) and the last W inputs of
  each short convolution. Constant in T.

The cache works on unpacked batches (no `cu_seqlens`): generation runs one sequence per batch row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class MLALayerCache:
    c_kv: torch.Tensor | None = None
    k_pe: torch.Tensor | None = None

    def update(self, c_kv_BTR: torch.Tensor, k_pe_BTP: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new tokens; return the full cached latent and roped key."""
        if self.c_kv is None:
            self.c_kv, self.k_pe = c_kv_BTR, k_pe_BTP
        else:
            self.c_kv = torch.cat([self.c_kv, c_kv_BTR], dim=1)
            self.k_pe = torch.cat([self.k_pe, k_pe_BTP], dim=1)
        return self.c_kv, self.k_pe

    @property
    def seq_len(self) -> int:
        return 0 if self.c_kv is None else self.c_kv.shape[1]

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.c_kv, self.k_pe) if t is not None]


@dataclass
class LinearLayerCache:
    """Recurrent state plus short-conv windows, keyed by name (e.g. 'q', 'k', 'v' for GDN)."""

    state: torch.Tensor | None = None
    conv: dict[str, torch.Tensor] = field(default_factory=dict)
    seen: int = 0

    def update(self, state: torch.Tensor, conv: dict[str, torch.Tensor], n_tokens: int) -> None:
        """After a forward over `n_tokens` more tokens: the new state and conv windows replace the old."""
        self.state = state
        self.conv = conv
        self.seen += n_tokens

    def tensors(self) -> list[torch.Tensor]:
        out = [] if self.state is None else [self.state]
        return out + list(self.conv.values())


class HyLoCache:
    """Per-layer caches of a HyLo model, indexed by layer number."""

    def __init__(self, config) -> None:
        self.config = config
        self.layers: list[MLALayerCache | LinearLayerCache] = [
            MLALayerCache() if config.layer_type(i) == "mla" else LinearLayerCache()
            for i in range(config.n_layer)
        ]
        self._seen = 0

    def __getitem__(self, idx: int) -> MLALayerCache | LinearLayerCache:
        return self.layers[idx]

    def __len__(self) -> int:
        return len(self.layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._seen

    def advance(self, n_tokens: int) -> None:
        """Called once per model forward, after all layers have run."""
        self._seen += n_tokens

    def nbytes(self) -> dict[str, int]:
        """Bytes held by the cache tensors, split by layer type."""
        out = {"mla": 0, "linear": 0}
        for layer in self.layers:
            key = "mla" if isinstance(layer, MLALayerCache) else "linear"
            out[key] += sum(t.numel() * t.element_size() for t in layer.tensors())
        out["total"] = out["mla"] + out["linear"]
        return out

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        for layer in self.layers:
            if isinstance(layer, MLALayerCache):
                if layer.c_kv is not None:
                    layer.c_kv = layer.c_kv.index_select(0, beam_idx)
                    layer.k_pe = layer.k_pe.index_select(0, beam_idx)
            else:
                if layer.state is not None:
                    layer.state = layer.state.index_select(0, beam_idx)
                layer.conv = {k: v.index_select(0, beam_idx) for k, v in layer.conv.items()}
