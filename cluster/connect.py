"""Connecting to Ray: an existing cluster when one is named, else a private local one."""
from __future__ import annotations

import os
from pathlib import Path

import ray


def connect(address: str | None, num_cpus: int | None = None) -> None:
    """Attach to `address` (or RAY_ADDRESS, as under `ray job submit`), else start Ray locally.

    A local Ray binds to 127.0.0.1 and runs without the dashboard; token authentication stays
    at Ray's default (on).
    """
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, namespace="jointrl", log_to_driver=True)
    else:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, namespace="jointrl",
                 _node_ip_address="127.0.0.1")
    tighten_token_file()


def tighten_token_file() -> None:
    """Ray writes its auth token world-readable; only its owner should read it."""
    token = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token"))
    if token.is_file():
        token.chmod(0o600)
