"""Compute kernels with their pure-torch references, imported as `hylo.kernels`.

When a checkout's root is on `sys.path` (PYTHONPATH, the current directory, `ray job submit --working-dir .`),
this folder can also be found under the top-level name `kernels`, which belongs to Hugging Face's kernels-hub
package (transformers probes for it on import). Imported under that name, the lines below hand the name to that
package where it is installed; where it is not, this stays an empty package without a version, which
transformers reports as not available, and without submodules (`kernels.varlen` would load a file of
`hylo.kernels` a second time as another module). The symlink hylo/kernels maps this folder to `hylo.kernels`.
"""

if __name__ == "kernels":
    import importlib.util as _util
    import sys as _sys
    from importlib.machinery import PathFinder as _PathFinder
    from pathlib import Path as _Path

    _root = _Path(__file__).resolve().parent.parent
    _spec = _PathFinder.find_spec("kernels", [p for p in _sys.path if _Path(p or ".").resolve() != _root])
    if _spec is not None and _spec.loader is not None:
        _other = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = _other
        _spec.loader.exec_module(_other)
    else:
        __path__ = []  # no submodules under this name
