"""Evaluation: KL/perplexity against a teacher, long-context retrieval, measured KV cache, lm-eval adapter."""
