"""Signals that stop a run: the first asks the run to stop after the step under way (it then
checkpoints the last completed step), a second stops at once.

SIGTERM is what a scheduler, `ray job stop` and Kubernetes send, SIGHUP what a closed terminal
sends; both are handled like Ctrl-C. A signal the process was started ignoring (`nohup` ignores
SIGHUP) stays ignored. The exit status is 128 + the signal's number, as a shell reports a process
the signal ended.
"""
from __future__ import annotations

import signal
import sys

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}


class StopNow(KeyboardInterrupt):
    """A second signal: stop at once, with the exit status of that signal."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.exit_code = EXIT_CODES[signum]


class Interrupts:
    """Installed for a `with` block in the main thread: the first signal calls the function given
    to `forward` (once there is one), a second raises StopNow."""

    def __init__(self):
        self.signum, self.second, self.previous, self.stop = None, None, {}, None

    def __enter__(self) -> "Interrupts":
        self.previous = {s: signal.signal(s, self.handle) for s in EXIT_CODES
                         if signal.getsignal(s) is not signal.SIG_IGN}
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        """Restores the handlers. A second signal that came while Ray waited leaves Ray's plain
        KeyboardInterrupt, not StopNow (its `check_signals` catches what the handler raised and
        reports only "interrupted"): it is raised again as the StopNow of that signal."""
        for s, handler in self.previous.items():
            signal.signal(s, handler)
        if self.second is not None and isinstance(exc, KeyboardInterrupt) and not isinstance(exc, StopNow):
            raise StopNow(self.second) from exc

    def handle(self, signum, frame) -> None:
        if self.signum is not None:
            self.second = signum
            raise StopNow(signum)
        self.signum = signum
        print(f"\njointrl: {signal.Signals(signum).name} received: finishing the step under way and saving a "
              f"checkpoint (send it again to stop at once)", file=sys.stderr, flush=True)
        if self.stop is not None:
            self.stop()

    def forward(self, stop) -> None:
        """From now on the first signal calls `stop()`; if it came already, call it now."""
        self.stop = stop
        if self.requested:
            stop()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.signum]

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name
