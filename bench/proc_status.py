"""Memory figures of the current process from /proc/self/status (Linux), shared by the memory benches."""

from __future__ import annotations

import threading
import time


def status_kib(key: str) -> int:
    """A `/proc/self/status` field in KiB, e.g. VmRSS, VmHWM, RssAnon."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{key} not in /proc/self/status")


class PeakSampler:
    """The peak of a /proc/self/status field over a block, sampled every `every_s` by a thread:

        with PeakSampler("RssAnon") as rss:
            step()
        rss.peak_kib - rss.base_kib     # what the block held at most beyond its start

    `mark()` inside the block: the peak so far (e.g. up to the optimiser step)."""

    def __init__(self, key: str = "RssAnon", every_s: float = 0.005) -> None:
        self.key, self.every_s = key, every_s
        self.base_kib = self.peak_kib = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.is_set():
            self.peak_kib = max(self.peak_kib, status_kib(self.key))
            time.sleep(self.every_s)

    def mark(self) -> int:
        return max(self.peak_kib, status_kib(self.key))

    def __enter__(self) -> PeakSampler:
        self.base_kib = self.peak_kib = status_kib(self.key)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.peak_kib = self.mark()
