"""Connecting to Ray: an existing cluster when one is named, else a private local one.

A private Ray belongs to the command that started it, and so do its signals. Schedulers stop a job
by signalling all of it at once: `timeout`, Slurm and a closed terminal signal the process group,
systemd (KillMode=control-group) every process of the unit. Ray's processes would die of that
signal under the run, and the run could no longer write its checkpoint (a Ray task writes it from
the snapshots in the object store). So a private Ray starts with SIGTERM, SIGHUP and SIGINT blocked
(a signal mask is inherited through fork and exec: GCS, raylet, agents and every worker the raylet
starts keep it; Ray itself blocks SIGINT the same way): only the command receives them, stops the
run after the step under way, checkpoints it and then ends Ray. SIGKILL cannot be blocked, and Ray's
processes die with the command (Ray's fate sharing) whatever the mask.
"""
from __future__ import annotations

import json
import logging
import os
import signal
from contextlib import contextmanager
from pathlib import Path

import psutil
import ray
from ray._private import ray_constants

from common.config import SettingError


def connect(address: str | None, num_cpus: int | None = None, log_file: Path | None = None,
            num_gpus: int | None = None, *, temp_dir: str | None = None, spill_dir: str | None = None) -> None:
    """Attach to `address` (or RAY_ADDRESS, as under `ray job submit`), else start Ray locally.

    A local Ray binds to 127.0.0.1 and runs without the dashboard; token authentication stays
    at Ray's default (on). `log_file`: Ray's own log lines (its start, the token authentication
    notice) go there instead of the terminal, and the actors' output stays in Ray's session logs
    (a failure still reaches the caller as an exception). `num_gpus`: the GPUs a local Ray declares
    (it does not look for them: `jointrl plan --place` checks a placement on a machine without any).
    `temp_dir`, `spill_dir`: a local Ray's session folder and where it spills objects (a cluster
    joined at an address keeps what its `ray start` set).
    The caller's signal handlers are kept (a local Ray would install its own for SIGTERM).
    """
    if ray.is_initialized():
        return
    to_file = logging.FileHandler(log_file) if log_file is not None else None
    if to_file:  # ray.init clears the `ray` logger's handlers: its own start-up lines come from ray._private
        to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        only_to(logging.getLogger("ray._private"), to_file)
    address = address or os.environ.get("RAY_ADDRESS")
    quiet = {"log_to_driver": to_file is None, "configure_logging": to_file is None}
    # Ray's C++ failure handler (stack traces on a crash) would take SIGTERM from this process's
    # handler as Ray starts, and reset it to the default as Ray ends: a signal then would kill the
    # command mid-stop. Off in this process only (its workers keep theirs).
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    # the Ray processes started now inherit the mask; a signal that comes meanwhile is handled by the
    # caller's handler, put back before the mask is lifted
    with signals_blocked(), handlers_kept():
        if address:
            ray.init(address=address, namespace="jointrl", **quiet)
        else:
            ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False,
                     namespace="jointrl", _node_ip_address="127.0.0.1", **local_folders(temp_dir, spill_dir), **quiet)
    if to_file:
        only_to(logging.getLogger("ray"), to_file)
        node = getattr(ray._private.worker, "_global_node", None)  # Ray has no public name for the folder
        if node is not None:
            logging.getLogger("ray").info("Ray's session logs (the actors' output): %s", node.get_logs_dir_path())
    tighten_token_file()


def connect_to(address: str | None, log_file: Path | None = None, cluster=None) -> None:
    """Ray (its own lines to `log_file` if given; a local one in the `cluster` section's temp_dir
    and spill_dir), or a SettingError naming the address and what a token-authenticated cluster
    needs."""
    folders = {"temp_dir": cluster.temp_dir, "spill_dir": cluster.spill_dir} if cluster else {}
    try:
        connect(address, log_file=log_file, **folders)
    except ConnectionError as e:
        raise SettingError(f"cannot connect to the Ray cluster at cluster.address={address!r} ({e}); a cluster "
                          f"with token authentication needs RAY_AUTH_MODE=token in this client's environment "
                          f"(and its token). Nothing was started.") from None


def local_folders(temp_dir: str | None, spill_dir: str | None) -> dict:
    """ray.init's arguments for a local Ray's session folder and its spill folder (absolute, made
    if absent: Ray takes them as they are)."""
    folders = {}
    if temp_dir:
        folders["_temp_dir"] = str(Path(temp_dir).expanduser().resolve())
    if spill_dir:
        where = Path(spill_dir).expanduser().resolve()
        where.mkdir(parents=True, exist_ok=True)
        folders["_system_config"] = {"object_spilling_config": json.dumps(
            {"type": "filesystem", "params": {"directory_path": str(where)}})}
    return folders


SHIELDED = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


@contextmanager
def signals_blocked():
    """SHIELDED blocked in this thread for the block: processes started in it inherit the mask; a
    signal that arrives meanwhile stays pending for this process and is handled once it ends."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, SHIELDED)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


@contextmanager
def handlers_kept():
    """The handlers of SHIELDED as they were before the block (ray.init sets one for SIGTERM that
    ends the process with status 1)."""
    before = {s: signal.getsignal(s) for s in SHIELDED}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


class RayGone(RuntimeError):
    """Ray ended under a run: its processes died (SIGKILL, the OOM killer, a cluster stopped) or
    the driver actor cannot be reached. Nothing more can be saved through it."""


def check_private_ray() -> None:
    """Raise RayGone naming the processes of the private local Ray this process started that have
    died (a cluster it only attached to has none of its own to check)."""
    node = getattr(ray._private.worker, "_global_node", None)
    dead = sorted({kind for kind, _ in node.dead_processes()}) if node is not None else []
    if dead:
        raise RayGone(f"Ray's {', '.join(dead)} process{'es' if len(dead) > 1 else ''} died")


def end_private_ray() -> None:
    """Shut Ray down. The processes of a private Ray have SIGTERM blocked, so Ray's graceful end
    (SIGTERM, a second's wait, SIGKILL, per process) would only wait: they are killed at once,
    after this process has left the cluster (the run has saved all it keeps). Killed so, the raylet
    leaves its agents behind: every process this one started is ended too."""
    node = getattr(ray._private.worker, "_global_node", None)
    private = node is not None and bool(node.all_processes)  # started here
    started = psutil.Process().children(recursive=True) if private else []
    if private:
        kill_all = node.kill_all_processes
        node.kill_all_processes = lambda **how: kill_all(**{**how, "allow_graceful": False})
    with signals_blocked(), handlers_kept():  # with its failure handler on, Ray's end resets SIGTERM's
        ray.shutdown()
    for process in started:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def only_to(logger: logging.Logger, handler: logging.Handler) -> None:
    """`logger` (and the loggers below it) write to `handler` only, from INFO up."""
    for old in list(logger.handlers):
        logger.removeHandler(old)
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def tighten_token_file() -> None:
    """Ray writes its auth token world-readable; only its owner should read it."""
    token = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token"))
    if token.is_file():
        token.chmod(0o600)
