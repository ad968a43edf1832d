"""Memory figures of the current process from /proc/self/status (Linux), shared by the memory benches."""

from __future__ import annotations


def status_kib(key: str) -> int:
    """A `/proc/self/status` field in KiB, e.g. VmRSS, VmHWM, RssAnon."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")
