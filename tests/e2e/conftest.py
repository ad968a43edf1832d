"""The shared tiny models and reference runs (tests/helpers/runs.py) for the end-to-end training tests
(test_train_e2e.py, test_train_e2e_ray.py, test_faults_cluster.py)."""

from tests.helpers.runs import reference, references, shared_root, tiny

__all__ = ["reference", "references", "shared_root", "tiny"]
