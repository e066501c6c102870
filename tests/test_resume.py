"""Exact resume after SIGKILL, and checkpoints that are corrupt, truncated or from another config."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import driver.cli as cli
from driver import checkpoint

ROOT = Path(__file__).resolve().parents[1]
RUN = ["--config", "shapes-tiny", "--set", "trainer.steps=8", "--set", "trainer.checkpoint_every=2",
       "--set", "cluster.mode=inline", "--set", "trainer.keep_checkpoints=2"]


def rows(run_dir: Path) -> list[dict]:
    """Metric rows without what measures the process rather than the training: timings, and the
    text encoder's cache hit rate (a restarted process starts with an empty cache)."""
    return [{k: v for k, v in json.loads(line).items() if not k.startswith("time/") and k != "text_encoder/cache_hit_rate"}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            if isinstance(x[k], float):
                assert abs(x[k] - y[k]) <= 1e-6, (x["step"], k, x[k], y[k])
            else:
                assert x[k] == y[k], (x["step"], k)


def kill_after_first_checkpoint(run_dir: Path) -> None:
    """Start a run in its own process group and SIGKILL the whole group once step 2 is saved."""
    proc = subprocess.Popen([sys.executable, "-m", "driver", "train", *RUN, "--run-dir", str(run_dir)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while not (run_dir / "checkpoints" / "step_000002" / "manifest.json").is_file():
        assert proc.poll() is None and time.time() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    assert cli.main(["train", *RUN, "--run-dir", str(run_dir)]) == 0
    return run_dir


def test_resume_after_sigkill_equals_the_uninterrupted_run(reference, tmp_path):
    """In one process; a resume on Ray equals its uninterrupted run in tests/test_async.py (a rollout
    in flight) and tests/test_parallel_experts.py (sharded, on two ranks)."""
    run_dir = tmp_path / "run"
    kill_after_first_checkpoint(run_dir)
    assert len(rows(run_dir)) < 8  # it really was cut short
    assert cli.main(["train", "--resume", str(run_dir)]) == 0
    assert_same(rows(run_dir), rows(reference))
    kept = [p.name for p in checkpoint.all_checkpoints(run_dir)]
    assert kept == ["step_000006", "step_000008"]  # keep_checkpoints=2
    assert checkpoint.manifest(run_dir / "checkpoints" / "step_000008")["versions"] == \
        checkpoint.manifest(reference / "checkpoints" / "step_000008")["versions"]


def test_optimizer_snapshots_every_few_updates_change_nothing_and_checkpoints_take_them(reference, tmp_path):
    """With the optimizer state kept every third update only (cluster.optimizer_snapshot_every=3),
    a checkpoint every two steps takes it where the latest snapshot lacks it: the run, and its
    resume from the step-4 checkpoint, equal the reference."""
    run_dir = tmp_path / "run"
    assert cli.main(["train", *RUN, "--set", "cluster.optimizer_snapshot_every=3", "--set", "trainer.keep_checkpoints=4",
                     "--run-dir", str(run_dir)]) == 0
    assert_same(rows(run_dir), rows(reference))
    for step in (6, 8):
        subprocess.run(["rm", "-rf", str(run_dir / "checkpoints" / f"step_{step:06d}")], check=True)
    assert cli.main(["train", "--resume", str(run_dir)]) == 0
    assert_same(rows(run_dir), rows(reference))


def snapshot(run_dir: Path) -> dict:
    return {p.relative_to(run_dir): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.fixture
def stopped_run(reference, tmp_path):
    """A copy of the reference run with its last checkpoint removed, as if it stopped at step 6."""
    run_dir = tmp_path / "stopped"
    subprocess.run(["cp", "-r", str(reference), str(run_dir)], check=True)
    subprocess.run(["rm", "-rf", str(run_dir / "checkpoints" / "step_000008")], check=True)
    return run_dir


def resume_fails(run_dir: Path, capsys, *extra: str) -> str:
    before = snapshot(run_dir) if run_dir.exists() else {}
    assert cli.main(["train", "--resume", str(run_dir), *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one paragraph
    assert (snapshot(run_dir) if run_dir.exists() else {}) == before  # nothing overwritten
    return err


def test_corrupt_checkpoint_is_named(stopped_run, capsys):
    target = stopped_run / "checkpoints" / "step_000006" / "generator.safetensors"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    err = resume_fails(stopped_run, capsys)
    assert "generator.safetensors" in err and "corrupt" in err


def test_truncated_checkpoint_is_named(stopped_run, capsys):
    target = stopped_run / "checkpoints" / "step_000006" / "refiner_1.safetensors"
    target.write_bytes(target.read_bytes()[:100])
    assert "refiner_1.safetensors" in resume_fails(stopped_run, capsys)


def test_checkpoint_without_manifest_is_named(stopped_run, capsys):
    (stopped_run / "checkpoints" / "step_000006" / "manifest.json").unlink()
    assert "manifest.json" in resume_fails(stopped_run, capsys)


def test_checkpoint_from_another_n_or_model_shape_is_refused(stopped_run, capsys):
    assert "refiner_3" in resume_fails(stopped_run, capsys, "--set", "experts.n_refiners=4")
    err = resume_fails(stopped_run, capsys, "--set", "experts.generator.model.d_model=32")
    assert "generator" in err and "shape" in err


def test_missing_or_finished_run_directory(reference, tmp_path, capsys):
    assert "not a run directory" in resume_fails(tmp_path / "nowhere", capsys)
    assert "complete" in resume_fails(reference, capsys)
    assert "drop --config" in resume_fails(reference, capsys, "--config", "shapes")


def test_init_weights_are_never_unpickled(tmp_path, capsys):
    import torch
    pickled = tmp_path / "generator.pt"
    torch.save({"weights": {}}, pickled)
    assert cli.main(["train", "--config", "shapes-tiny", "--set", f"experts.generator.init={pickled}",
                     "--set", "cluster.mode=inline", "--run-dir", str(tmp_path / "run")]) == 2
    assert "safetensors" in capsys.readouterr().err
