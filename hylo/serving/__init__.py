"""Serving a HyLo model in vLLM: the `hylo` plugin (`plugin.py`), the model (`vllm_model.py`), the exact widening
of the MLA latent to a width vLLM takes (`widen.py`, torch only) and vLLM's CPU limits (`vllm_compat.py`).

Only `widen.py` and `widths.py`'s constants import without vLLM; the rest runs inside vLLM's processes.
"""
