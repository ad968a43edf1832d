"""The jobs: thin entry points, each `main(argv)` (`python jobs/NAME.py` of a checkout, or `hylo NAME`), the
package `hylo.jobs` (the symlink hylo/jobs maps it).

Imported under another name (the top-level `jobs`, when a checkout's root is on sys.path), it refuses: its
files would load a second time as other modules.
"""

if __name__ != "hylo.jobs":
    raise ImportError(f"the folder jobs/ is the package hylo.jobs: import hylo.jobs, not {__name__}")
