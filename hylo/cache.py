"""HyLoCache: the generation cache of a hybrid model, a `transformers.Cache` so `generate()` works as is.

Legend: B batch, T cached tokens, R kv_lora_rank, P qk_rope_head_dim, H heads, K/V GDN key/value
head dims, C conv channels, W conv_size - 1.

* MLA layer: `c_kv_BTR` (the RMS-normalised latent) and `k_pe_BTP` (the roped shared key), side by side
  in one preallocated buffer; with `mla_qk_norm` also `k_inv_rms_BTG`, each kv_b head's key 1/RMS (G
  values per token; k_pe then carries k_norm's rope weight). Nothing else: the decode path absorbs `W_kvb`
  into the query, so full K/V are never stored.
* Linear layer (GDN / Mamba-2): a recurrent state (`state_BHKV` for GDN) and the last W inputs of
  each short convolution. Constant in T.
* `HyLoCache` subclasses `transformers.cache_utils.Cache` with these two layer kinds, so transformers'
  `GenerationMixin` (greedy, sampling, beam search with `reorder_cache`, streamers, stopping criteria)
  drives it unchanged. It cannot be cropped (a recurrent state cannot be rolled back), so assisted /
  speculative decoding is refused with a clear error.
* Left-padded batches: the cache holds a slot for every position, pads included (so `get_seq_length`
  matches the attention mask's length, as transformers expects); MLA masks the pad keys and the linear
  layers never feed pad tokens into their state (see `hylo/modeling.py`).

The cache works on unpacked batches (no `cu_seqlens`): generation runs one sequence per batch row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

NOT_CROPPABLE = ("a HyLo cache cannot be cropped or rolled back (linear layers keep a recurrent state, not per-token "
                 "entries): assisted / speculative decoding and prompt-lookup decoding are not supported")


class _LayerInterface:
    """What transformers' Cache asks of every layer and is the same for both kinds: no compiling,
    cropping or sliding window, no offloading, no length limit."""

    is_compileable = False
    is_croppable = False
    is_sliding = False
    supports_early_init = False

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(NOT_CROPPABLE)

    def offload(self) -> None:
        pass

    def prefetch(self) -> None:
        pass


class MLALayerCache(_LayerInterface):
    """Latent + roped key (+ key 1/RMS per head) of every cached token in one preallocated buffer `kv_BCX`
    (X = R + P, or R + P + G with the q/k norm).

    The buffer holds `[c_kv | k_pe (| k_inv_rms)]` per token; the decode path attends over its first R + P
    columns (one key/value head), so a decode step writes its token in place and copies nothing: appending
    by `torch.cat` copied the whole cache three times per step and layer (c_kv, k_pe, and their concatenation).
    Capacity: `reserve` tokens on the first update when given (generation passes prompt + new tokens,
    so the allocation is exact), otherwise what the first update needs; when full it grows by half.
    """

    def __init__(self, reserve: int = 0) -> None:
        self.reserve = int(reserve)
        self.buf: torch.Tensor | None = None
        self.rank = 0
        self.rope = 0
        self.length = 0

    def update(self, c_kv_BTR: torch.Tensor, k_pe_BTP: torch.Tensor,
               k_inv_rms_BTG: torch.Tensor | None = None) -> torch.Tensor:
        """Append new tokens; return the cached `[c_kv | k_pe (| k_inv_rms)]` of all tokens so far, [B, S, X]."""
        B, T, R = c_kv_BTR.shape
        P = k_pe_BTP.shape[-1]
        G = 0 if k_inv_rms_BTG is None else k_inv_rms_BTG.shape[-1]
        need = self.length + T
        if self.buf is None:
            self.rank, self.rope = R, P
            cap = max(need, self.reserve)
            self.buf = c_kv_BTR.new_empty(B, cap, R + P + G)
        elif self.buf.shape[2] != R + P + G:
            raise ValueError(f"MLALayerCache: this cache holds {self.buf.shape[2]} values per token, the update "
                             f"gives {R + P + G} (R={R}, P={P}, key 1/RMS heads={G}): one layer kind per cache")
        elif need > self.buf.shape[1]:
            cap = max(need, self.buf.shape[1] + self.buf.shape[1] // 2)
            grown = self.buf.new_empty(self.buf.shape[0], cap, self.buf.shape[2])
            grown[:, : self.length] = self.buf[:, : self.length]
            self.buf = grown
        self.buf[:, self.length:need, :R] = c_kv_BTR
        self.buf[:, self.length:need, R:R + P] = k_pe_BTP
        if k_inv_rms_BTG is not None:
            self.buf[:, self.length:need, R + P:] = k_inv_rms_BTG
        self.length = need
        return self.buf[:, :need]

    @property
    def seq_len(self) -> int:
        return self.length

    @property
    def c_kv(self) -> torch.Tensor | None:
        """The cached normalised latents [B, S, R] (a view)."""
        return None if self.buf is None else self.buf[:, : self.length, : self.rank]

    @property
    def k_pe(self) -> torch.Tensor | None:
        """The cached roped shared keys [B, S, P] (a view)."""
        return None if self.buf is None else self.buf[:, : self.length, self.rank: self.rank + self.rope]

    @property
    def k_inv_rms(self) -> torch.Tensor | None:
        """With the q/k norm: each kv_b head's key 1/RMS [B, S, G] (a view); None otherwise."""
        if self.buf is None or self.buf.shape[2] == self.rank + self.rope:
            return None
        return self.buf[:, : self.length, self.rank + self.rope:]

    @property
    def capacity(self) -> int:
        return 0 if self.buf is None else self.buf.shape[1]

    def tensors(self) -> list[torch.Tensor]:
        """What the cache holds: the whole allocated buffer (capacity, not only the cached tokens)."""
        return [] if self.buf is None else [self.buf]

    def used_nbytes(self) -> int:
        return 0 if self.buf is None else self.buf.shape[0] * self.length * self.buf.shape[2] * self.buf.element_size()

    # ---- the layer interface transformers' Cache calls (beam search, batch expansion, reset)
    def get_seq_length(self) -> int:
        return self.length

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search: row i takes row beam_idx[i]. In place on the cached part; the capacity is kept."""
        if self.buf is None:
            return
        idx = beam_idx.to(self.buf.device)
        if idx.numel() != self.buf.shape[0]:
            self.buf = self.buf.index_select(0, idx)
            return
        used = self.buf[:, : self.length]
        used.copy_(used.index_select(0, idx))

    index_select = reorder_cache

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.buf is not None:
            self.buf = self.buf.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.buf is not None:
            self.buf = self.buf[indices]

    def reset(self) -> None:
        self.length = 0


@dataclass
class LinearLayerCache(_LayerInterface):
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

    # ---- the layer interface transformers' Cache calls
    def get_seq_length(self) -> int:
        return self.seen

    def _apply(self, fn) -> None:
        if self.state is not None:
            self.state = fn(self.state)
        self.conv = {k: fn(v) for k, v in self.conv.items()}

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply(lambda t: t[indices])

    def reset(self) -> None:
        self.state, self.conv, self.seen = None, {}, 0


class HyLoCache(Cache):
    """Per-layer caches of a HyLo model, indexed by layer number."""

    def __init__(self, config, max_length: int | None = None) -> None:
        """`max_length`: the most tokens this cache will hold (prompt + new tokens), when known: each MLA
        layer then allocates exactly that once instead of growing."""
        layers: list[MLALayerCache | LinearLayerCache] = [
            MLALayerCache(reserve=max_length or 0) if config.layer_type(i) == "mla" else LinearLayerCache()
            for i in range(config.n_layer)
        ]
        super().__init__(layers=layers)
        self.config = config
        self._seen = 0

    def __getitem__(self, idx: int) -> MLALayerCache | LinearLayerCache:
        return self.layers[idx]

    def __len__(self) -> int:
        return len(self.layers)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions held (pads of a left-padded batch included), the same for every layer."""
        return self._seen

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._seen + query_length, 0

    def advance(self, n_tokens: int) -> None:
        """Called once per model forward, after all layers have run."""
        self._seen += n_tokens

    def nbytes(self) -> dict[str, int]:
        """Bytes allocated by the cache tensors, split by layer type; `mla_used`: the cached tokens' part."""
        out = {"mla": 0, "linear": 0, "mla_used": 0}
        for layer in self.layers:
            key = "mla" if isinstance(layer, MLALayerCache) else "linear"
            out[key] += sum(t.numel() * t.element_size() for t in layer.tensors())
            if isinstance(layer, MLALayerCache):
                out["mla_used"] += layer.used_nbytes()
        out["total"] = out["mla"] + out["linear"]
        return out

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        for layer in self.layers:
            layer.reorder_cache(beam_idx)

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        self._seen = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(NOT_CROPPABLE)

    @property
    def batch_size(self) -> int:
        for layer in self.layers:
            t = layer.tensors()
            if t:
                return t[0].shape[0]
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_linear(self) -> list[bool]:
        return [isinstance(layer, LinearLayerCache) for layer in self.layers]

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * len(self.layers)

    @property
    def is_initialized(self) -> bool:
        return self._seen > 0
