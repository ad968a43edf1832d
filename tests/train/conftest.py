"""The shared tiny models and reference runs (tests/helpers/runs.py) for the sequence-parallel runs of
test_train_seq_parallel.py."""

from tests.helpers.runs import reference, references, shared_root, tiny

__all__ = ["reference", "references", "shared_root", "tiny"]
