"""HyLo: hybrid MLA + linear-attention models upcycled from pretrained Transformers.

One import namespace for everything the distribution installs: `hylo` (the model and converter),
`hylo.kernels`, `hylo.pipeline`, `hylo.jobs` and `hylo.configs` (the shipped YAML configs). In the repository
those are the folders `kernels/`, `pipeline/`, `jobs/` and `configs/` beside `hylo/` (pyproject.toml maps them with `package-dir`, so a wheel and an
editable install hold them under `hylo/`); in a checkout used without installing (PYTHONPATH, `ray job
submit --working-dir .`), the lines below give the same names by adding the checkout's root to this
package's search path.
"""

from pathlib import Path as _Path

__version__ = "0.1.0"

_root = _Path(__file__).resolve().parent.parent
if not (_Path(__file__).resolve().parent / "pipeline").is_dir() and all(
        (_root / sub / "__init__.py").is_file() for sub in ("kernels", "pipeline", "jobs")):
    __path__.append(str(_root))
del _root
