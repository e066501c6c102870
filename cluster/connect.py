"""Connecting to Ray: an existing cluster when one is named, else a private local one."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import ray


def connect(address: str | None, num_cpus: int | None = None, log_file: Path | None = None,
            num_gpus: int | None = None) -> None:
    """Attach to `address` (or RAY_ADDRESS, as under `ray job submit`), else start Ray locally.

    A local Ray binds to 127.0.0.1 and runs without the dashboard; token authentication stays
    at Ray's default (on). `log_file`: Ray's own log lines (its start, the token authentication
    notice) go there instead of the terminal, and the actors' output stays in Ray's session logs
    (a failure still reaches the caller as an exception). `num_gpus`: the GPUs a local Ray declares
    (it does not look for them: `jointrl plan --place` checks a placement on a machine without any).
    """
    if ray.is_initialized():
        return
    to_file = logging.FileHandler(log_file) if log_file is not None else None
    if to_file:  # ray.init clears the `ray` logger's handlers: its own start-up lines come from ray._private
        to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        only_to(logging.getLogger("ray._private"), to_file)
    address = address or os.environ.get("RAY_ADDRESS")
    quiet = {"log_to_driver": to_file is None, "configure_logging": to_file is None}
    if address:
        ray.init(address=address, namespace="jointrl", **quiet)
    else:
        ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False, namespace="jointrl",
                 _node_ip_address="127.0.0.1", **quiet)
    if to_file:
        only_to(logging.getLogger("ray"), to_file)
        node = getattr(ray._private.worker, "_global_node", None)  # Ray has no public name for the folder
        if node is not None:
            logging.getLogger("ray").info("Ray's session logs (the actors' output): %s", node.get_logs_dir_path())
    tighten_token_file()


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
