"""The pipeline (Ray Data, Serve, Train), the package `hylo.pipeline` (the symlink hylo/pipeline maps it).

Imported under another name (the top-level `pipeline`, when a checkout's root is on sys.path), it refuses:
its files would load a second time as other modules, with their own globals and classes.
"""

if __name__ != "hylo.pipeline":
    raise ImportError(f"the folder pipeline/ is the package hylo.pipeline: import hylo.pipeline, not {__name__}")
