"""One local Ray per test session, and a helper that runs a training config to completion."""
from __future__ import annotations

import itertools
import json

import pytest
import ray

from cluster.runtime import get
from driver.config import load_config
from driver.launch import start_driver, stop_driver

_names = itertools.count()


@pytest.fixture(scope="session")
def ray_session():
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="jointrl",
             _node_ip_address="127.0.0.1")
    yield
    ray.shutdown()


def make_config(*overrides: str, preset: str = "shapes"):
    return load_config(preset, list(overrides))


def run_training(config, run_dir, inspect_weights: tuple[str, ...] = ()):
    """Train `config` to completion; returns (metric rows, the driver's inspect(), weights asked for)."""
    if config.trainer.run_name is None:
        config.trainer.run_name = f"test-{next(_names)}-{run_dir.name}"
    driver = start_driver(config, run_dir)
    get(driver.run.remote())
    info = get(driver.inspect.remote())
    weights = {e: get(driver.expert_weights.remote(e)) for e in inspect_weights}
    stop_driver(driver)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, info, weights


def mean(rows, key):
    return sum(r[key] for r in rows) / len(rows)
