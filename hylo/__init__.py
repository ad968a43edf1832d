"""HyLo: hybrid MLA + linear-attention models upcycled from pretrained Transformers."""

__version__ = "0.1.0"
