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

    # skip every checkout of this project on sys.path, not only this one: with two (PYTHONPATH and the copy
    # `ray job submit --working-dir` puts first) each would hand the name to the other without end
    _skip = {_Path(__file__).resolve().parent.parent}
    while True:
        _spec = _PathFinder.find_spec("kernels", [p for p in _sys.path if _Path(p or ".").resolve() not in _skip])
        _origin = _Path(_spec.origin) if _spec is not None and _spec.origin else None
        if _origin is None or not _origin.is_file() or b"imported as `hylo.kernels`" not in _origin.read_bytes():
            break
        _skip.add(_origin.resolve().parent.parent)
    if _spec is not None and _spec.loader is not None:
        _other = _util.module_from_spec(_spec)
        _sys.modules["kernels"] = _other
        _spec.loader.exec_module(_other)
    else:
        __path__ = []  # no submodules under this name
