"""Ctrl-C and SIGTERM while a run trains: the first asks the run to stop after the step under way
(it then checkpoints the last completed step), a second stops at once.

SIGTERM is what a scheduler, `ray job stop` and Kubernetes send; it is handled like Ctrl-C.
"""
from __future__ import annotations

import signal
import sys

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Interrupts:
    """Installed for a `with` block in the main thread: `on_first()` runs on the first signal, a
    second raises KeyboardInterrupt."""

    def __init__(self, on_first=lambda: None):
        self.on_first, self.signum, self.previous = on_first, None, {}

    def __enter__(self) -> "Interrupts":
        self.previous = {s: signal.signal(s, self.handle) for s in EXIT_CODES}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def handle(self, signum, frame) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        print(f"\njointrl: {signal.Signals(signum).name} received: finishing the step under way and saving a "
              f"checkpoint (send it again to stop at once)", file=sys.stderr, flush=True)
        self.on_first()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.signum]

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name
