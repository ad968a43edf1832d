"""HyLo: hybrid MLA + linear-attention models upcycled from pretrained Transformers.

One import namespace for everything the distribution installs: `hylo` (the model and converter),
`hylo.kernels`, `hylo.pipeline`, `hylo.jobs` and `hylo.configs` (the shipped YAML configs). In the repository
those are the folders `kernels/`, `pipeline/`, `jobs/` and `configs/` beside `hylo/`; the mapping is the
symlinks `hylo/kernels`, `hylo/pipeline`, `hylo/jobs` and `hylo/configs` (one place), which a wheel, an
editable install, a checkout on PYTHONPATH (`ray job submit --working-dir .`), ruff and pyright all follow.
Imported under a top-level name (`pipeline`, `jobs`, `configs`), those folders refuse, so that no file loads
as two modules.
"""

__version__ = "0.1.0"
