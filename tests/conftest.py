"""Session set-up shared by every test."""

from __future__ import annotations

import signal


def pytest_configure(config) -> None:
    # A shell starts a background job (`make test &`, `nohup ... &`) with SIGINT ignored, and a child inherits an
    # ignored signal: the Ctrl-C tests would then send SIGINT to processes that never see it. Ctrl-C is
    # Python's default KeyboardInterrupt again for this process, and children start with the default action.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
