"""One run per folder: while a run trains, its process holds an exclusive OS lock (flock) on
RUN_DIR/.lock. The lock dies with the process, so a crashed run leaves no stale marker; the file
says who holds it, for the message a second run gets."""
from __future__ import annotations

import fcntl
import os
import socket
from contextlib import contextmanager
from pathlib import Path

from common.config import SettingError


@contextmanager
def run_lock(run_dir: Path, flag: str = "--run-dir"):
    """Hold RUN_DIR's lock for the block, making the folder if needed; refuse (SettingError) a
    folder another run holds, or one that cannot be made or written."""
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(run_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise SettingError(f"{flag} '{run_dir}': cannot make or write it ({e.strerror}); choose a writable "
                          f"folder. Nothing was started.") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            raise SettingError(f"{flag} '{run_dir}' is in use by another run ({holder}); wait for it to end or "
                              f"choose another folder. Nothing was started.") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        yield
    finally:
        os.close(fd)
