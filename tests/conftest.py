"""One local Ray per test session, and helpers that run training configs (with kills if asked) and
compare or look at what they wrote."""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import tempfile
from pathlib import Path

import numpy as np
import pytest
import ray

from cluster.runtime import get
from driver.preflight import load_config
from driver.launch import follow, start_driver, stop_driver

_names = itertools.count()


def pytest_configure(config):
    """Tiny random models (`tiny:<kind>`) are built once per test session into a fresh folder, so
    no test reads a cache another version of a builder wrote; Ray's workers inherit the variable,
    and so do pytest-xdist's, which share the session's folder (a build is atomic: common/tiny.py)
    and write the groups they collected beside it (`TestGroups`)."""
    if not hasattr(config, "workerinput"):  # not an xdist worker: the session's process itself
        os.environ["JOINTRL_TINY_CACHE"] = tempfile.mkdtemp(prefix="jointrl-tiny-")
        os.environ["JOINTRL_TEST_GROUPS"] = tempfile.mkdtemp(prefix="jointrl-test-groups-")


def group_of(item) -> str:
    """Which worker-sized group a test belongs to: the tests on the session's Ray ("session-ray"),
    the tests that start processes of their own: a Ray, the command, vLLM engines ("own-processes"),
    else its module."""
    if "ray_session" in item.fixturenames:
        return "session-ray"
    if item.get_closest_marker("cluster") or item.get_closest_marker("engine"):
        return "own-processes"
    return item.module.__name__


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """`cluster`: a test on the session's local Ray. The fast tier (`make test-fast`) leaves out these,
    the tests marked `cluster` by hand (they start the command, a Ray or a cluster of their own),
    `engine` (vLLM engines) and `slow` (learning over tens of steps). An xdist worker writes each
    test's group for the session's scheduler."""
    for item in items:
        if "ray_session" in item.fixturenames:
            item.add_marker(pytest.mark.cluster)
    if hasattr(config, "workerinput"):
        where = Path(os.environ["JOINTRL_TEST_GROUPS"]) / f"{config.workerinput['workerid']}.json"
        where.write_text(json.dumps({item.nodeid: group_of(item) for item in items}))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`make test` and `make test-fast` run on two pytest-xdist workers (`-n 2 --dist loadgroup`),
    a group (`group_of`) at a time, in order, on one worker: so the session has one Ray, which
    one worker starts; no two tests that start processes of their own load the machine at once; a
    module's fixtures are made once. (xdist's own loadgroup reads `xdist_group` marks into node
    ids, which pytest 9.2's node ids no longer take: the groups come from the workers' files.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class TestGroups(LoadScopeScheduling):
        groups: dict[str, str] | None = None  # read once, when the workers have all collected

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                self.groups = {}
                for written in Path(os.environ["JOINTRL_TEST_GROUPS"]).glob("*.json"):
                    self.groups.update(json.loads(written.read_text()))
            return self.groups.get(nodeid) or nodeid.split("::")[0]

    return TestGroups(config, log)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module's tests: tiny models on cores shared with Ray's processes
    (and bf16 on the CPU) run faster on one thread each than contending for both."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def ray_session():
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="jointrl",
             _node_ip_address="127.0.0.1")
    yield
    ray.shutdown()


def as_a_terminal_starts_it() -> None:
    """In the child, before it runs: the stop signals at their defaults and unblocked, as a shell or a
    scheduler starts a job (a test session run in the background of a script ignores SIGINT, and a
    child inherits an ignored signal; the command keeps what it was started ignoring)."""
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))


def make_config(*overrides: str, preset: str = "shapes"):
    """The tests' runs of the `shapes` preset start from random weights, as they were written for
    (tests/test_shipped_base.py runs the shipped base the preset starts from)."""
    start = ["experts.base=null"] if preset == "shapes" else []
    return load_config(preset, [*start, *overrides])


def trained_inline(run_dir, preset: str, steps: int, *sets: str):
    """`jointrl train --config preset` of `steps` steps in one process into `run_dir`, with `--set`
    each of `sets`, as a user runs it."""
    from driver import cli
    assert cli.main(["train", "--config", preset, "--set", "cluster.mode=inline", "--set", f"trainer.steps={steps}",
                     *(a for s in sets for a in ("--set", s)), "--run-dir", str(run_dir)]) == 0
    return run_dir


def run_training(config, run_dir, inspect_weights: tuple[str, ...] = ()):
    """Train `config` to completion; returns (metric rows, the driver's inspect(), weights asked for)."""
    if config.trainer.run_name is None:
        config.trainer.run_name = f"test-{next(_names)}-{run_dir.name}"
    driver = start_driver(config, run_dir)
    get(driver.run.remote())
    info = get(driver.inspect.remote())
    weights = {e: get(get(driver.expert_weights.remote(e))) for e in inspect_weights}
    stop_driver(driver)
    rows = read_metrics(run_dir)
    return rows, info, weights


def mean(rows, key):
    return sum(r[key] for r in rows) / len(rows)


def read_metrics(run_dir) -> list[dict]:
    """The rows of a run's metrics.jsonl."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def training_metrics(rows: list[dict]) -> list[dict]:
    """What training computes, without what measures the process (timings, faults, the sync path,
    cache hits): the part of two runs' metrics that must agree."""
    return [{k: v for k, v in r.items() if not k.startswith(("time/", "faults/", "sync/"))
             and k != "text_encoder/cache_hit_rate"} for r in rows]


def assert_same_training(a: list[dict], b: list[dict], tol: float = 1e-6) -> None:
    """Two runs' training metrics agree step for step (floats to `tol`: batch splits round apart)."""
    assert len(a) == len(b)
    for x, y in zip(training_metrics(a), training_metrics(b)):
        assert x.keys() == y.keys(), sorted(set(x) ^ set(y))
        for k in x:
            same = abs(x[k] - y[k]) <= tol if isinstance(x[k], float) and isinstance(y[k], float) else x[k] == y[k]
            assert same, (x["step"], k, x[k], y[k])


def run_killing(config, run_dir, kills: list[tuple[int, str]]) -> tuple[list[dict], dict]:
    """Train `config` on Ray; for each (n, victim) of `kills`, kill the actor `victim` (e.g.
    "rollout/1"; Ray restarts it) as soon as the run has logged n steps, at whatever moment of a
    step that lands. Returns (metric rows, the driver's inspect())."""
    import time
    config.trainer.run_name = config.trainer.run_name or f"kill-{next(_names)}"
    driver = start_driver(config, run_dir)
    done, seen = driver.run.remote(), 0
    for n, victim in kills:
        seen = follow(driver, done, seen=seen, until=lambda rows, n=n: rows >= n, interval_s=0.05)
        if seen < n:
            get(done)  # raises the run's error, if it failed
            pytest.fail("the run finished before the kill")
        ray.kill(ray.get_actor(f"{config.trainer.run_name}/{victim}", namespace="jointrl"), no_restart=False)
        time.sleep(0.3)
    get(done)
    info = get(driver.inspect.remote())
    stop_driver(driver)
    return read_metrics(run_dir), info


def looks_like_a_picture(path, min_size=(300, 200)) -> None:
    """A PNG that opens, is at least `min_size`, and is not one flat colour."""
    from PIL import Image
    with Image.open(path) as im:
        assert im.size[0] >= min_size[0] and im.size[1] >= min_size[1], (path, im.size)
        pixels = np.asarray(im.convert("RGB"), dtype=np.float32)
    assert pixels.std() > 5.0, f"{path} is blank"


def assert_same_rollout(a, b, tol: float = 1e-6) -> None:
    """Two rollouts' outputs (experts/pipeline.py RolloutOutputs) agree: metadata, the generator's
    trajectories and every refiner's token batch (floats to `tol`, images to one grey level)."""
    from experts.trajectories import device_tensors

    def close(x, y, what):
        np.testing.assert_allclose(np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64), rtol=0, atol=tol,
                                   equal_nan=True, err_msg=what)

    for field in ("samples", "versions", "refinements"):
        assert getattr(a.meta, field) == getattr(b.meta, field), field
    np.testing.assert_array_equal(a.meta.valid, b.meta.valid)
    assert a.meta.terms.keys() == b.meta.terms.keys() and a.meta.counterfactual.keys() == b.meta.counterfactual.keys()
    for t in a.meta.terms:
        close(a.meta.terms[t], b.meta.terms[t], f"reward term {t}")
    for e, terms in a.meta.counterfactual.items():
        for t in terms:
            close(terms[t], b.meta.counterfactual[e][t], f"counterfactual {e} {t}")
    assert (a.meta.images is None) == (b.meta.images is None)
    if a.meta.images is not None:
        assert np.abs(a.meta.images.astype(int) - b.meta.images).max() <= 1
    x, y = a.trajectories, b.trajectories
    for field in ("state_steps", "sigmas", "sde"):
        np.testing.assert_array_equal(getattr(x, field), getattr(y, field), err_msg=field)
    close(x.states, y.states, "states")
    close(x.logps, y.logps, "log-probs")
    assert x.dtypes == y.dtypes
    for field in ("cond", "shared_cond"):
        ours, theirs = device_tensors(getattr(x, field), x.dtypes), device_tensors(getattr(y, field), y.dtypes)
        assert ours.keys() == theirs.keys() and all(v.shape == theirs[k].shape for k, v in ours.items()), field
        for k, v in ours.items():
            close(v.float(), theirs[k].float(), f"{field} {k}")
    assert a.tokens.keys() == b.tokens.keys()
    for e, batch in a.tokens.items():
        assert batch["prompts"] == b.tokens[e]["prompts"], e
        if batch["prompts"]:
            np.testing.assert_array_equal(batch["tokens"], b.tokens[e]["tokens"])
            np.testing.assert_array_equal(batch["mask"], b.tokens[e]["mask"])
            close(batch["logps"], b.tokens[e]["logps"], f"{e} token log-probs")


@contextlib.contextmanager
def gradients_applied(expert):
    """The gradients each optimizer step of `expert` applies (clipped), in a list filled as it steps:
    an update frees them once applied."""
    applied = []
    hook = expert.optimizer.register_step_pre_hook(
        lambda *_: applied.append([p.grad.detach().clone() for p in expert.trainable]))
    try:
        yield applied
    finally:
        hook.remove()
