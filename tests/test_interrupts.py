"""Nothing is lost when a person or a scheduler stops a run: SIGINT, SIGTERM and SIGHUP, to the run's
process, its process group or every process it started, checkpoint the step under way and the
resumed run equals the uninterrupted one; one run per folder; resume refuses what would
change the weights; every command reads its config the same way; every refusal is exit 2."""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

import driver.cli as cli
from tests.conftest import as_a_terminal_starts_it, assert_same_training, make_config, run_training

pytestmark = pytest.mark.cluster  # its tests start the command in a process of its own, or a Ray cluster

ROOT = Path(__file__).resolve().parents[1]
STEPS = 8
# The runs here have one refiner: a signal is handled the same whatever the number of experts, and
# each refiner is one more process to start (every kind of actor is still there).
TINY = ("--config", "shapes-tiny", "--set", "experts.n_refiners=1")


def start(*args: str) -> subprocess.Popen:
    """`python -m driver ARGS` in its own process (its own Ray, when it runs on Ray), in a process
    group of its own as a scheduler's job is."""
    return subprocess.Popen([sys.executable, "-m", "driver", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=as_a_terminal_starts_it)


def rows(run_dir: Path) -> list[dict]:
    """The metric rows written whole so far (the run may be writing the next one as it is read)."""
    path = run_dir / "metrics.jsonl"
    whole = path.read_text().rpartition("\n")[0] if path.is_file() else ""
    return [json.loads(line) for line in whole.splitlines()]


def wait_for_rows(proc: subprocess.Popen, run_dir: Path, n: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(rows(run_dir)) < n:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.02)


def signal_to(proc: subprocess.Popen, target: str, sig: int) -> None:
    """`sig` to the run's `pid`, its process `group` (what `timeout`, Slurm and a closed terminal
    send), or `every` process it started at once (what systemd sends to a unit's cgroup)."""
    if target == "pid":
        proc.send_signal(sig)
    elif target == "group":
        os.killpg(proc.pid, sig)
    else:
        for process in [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(sig)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The reference: the same run, never stopped, in-process."""
    got, _, _ = run_training(make_config(f"trainer.steps={STEPS}", "cluster.mode=inline", "experts.n_refiners=1",
                                         preset="shapes-tiny"),
                             tmp_path_factory.mktemp("reference"))
    return got


# On Ray each signal and each target once (SIGTERM to the group: the second-signal tests below):
# Ray's processes are started with all three blocked, whoever is sent which.
@pytest.mark.parametrize("mode, target, sig", [
    ("ray", "group", signal.SIGINT), ("ray", "every", signal.SIGHUP), ("ray", "pid", signal.SIGTERM),
    ("inline", "pid", signal.SIGTERM), ("inline", "group", signal.SIGHUP)])
def test_a_signal_checkpoints_the_step_under_way_and_the_resumed_run_equals_the_uninterrupted_one(
        uninterrupted, tmp_path, mode, target, sig):
    """Ray's processes under a run keep running whoever receives the signal: the run stops after the
    step under way (in ray mode also the next, where the step ended within the 0.1 s the command
    takes to pass the stop on), checkpoints it, and exits 128 + the signal's number."""
    run_dir = tmp_path / "run"
    proc = start("train", *TINY, "--set", f"trainer.steps={STEPS}", "--set",
                 f"cluster.mode={mode}", "--run-dir", str(run_dir))
    wait_for_rows(proc, run_dir, 2)
    under_way = len(rows(run_dir))
    signal_to(proc, target, sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err[-2000:]
    assert "Traceback" not in err and f"resume with: jointrl train --resume {run_dir}" in out
    done = len(rows(run_dir))
    assert under_way <= done <= under_way + (1 if mode == "inline" else 2) and done < STEPS, (under_way, done)
    assert (run_dir / "checkpoints" / f"step_{done:06d}" / "manifest.json").is_file()
    if target == "pid" or (mode, target) == ("ray", "group"):  # one checkpoint writer: 3 resumes suffice
        resumed = start("train", "--resume", str(run_dir), "--set", "cluster.mode=inline")  # Ray's: test_resume
        out, err = resumed.communicate(timeout=300)
        assert resumed.returncode == 0, err[-2000:]
        assert_same_training(rows(run_dir), uninterrupted)


def test_a_second_interrupt_stops_at_once(tmp_path):
    run_dir = tmp_path / "run"
    proc = start("train", *TINY, "--set", "trainer.steps=200", "--set", "cluster.mode=inline",
                 "--run-dir", str(run_dir))
    wait_for_rows(proc, run_dir, 1)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "stopped at once" in err and "Traceback" not in err, err[-2000:]


@pytest.mark.parametrize("delay_s", [0.0, 0.5])
def test_a_second_signal_to_the_group_while_the_run_checkpoints_leaves_every_checkpoint_whole(tmp_path, delay_s):
    """Whatever the second signal interrupts (the step, the checkpoint, Ray's end), each checkpoint
    that exists verifies, and one that was cut short is a temporary folder no resume reads."""
    from driver import checkpoint
    run_dir = tmp_path / "run"
    proc = start("train", *TINY, "--set", "trainer.steps=200", "--set",
                 "trainer.checkpoint_every=1", "--run-dir", str(run_dir))
    wait_for_rows(proc, run_dir, 3)
    os.killpg(proc.pid, signal.SIGTERM)
    time.sleep(delay_s)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "Traceback" not in err, (out[-1000:], err[-2000:])
    saved = checkpoint.all_checkpoints(run_dir)
    assert saved and all(checkpoint.manifest(c) for c in saved)
    assert all(p.name.endswith(".tmp") for p in (run_dir / "checkpoints").iterdir() if p not in saved)
    resumed = start("train", "--resume", str(run_dir), "--set", "cluster.mode=inline", "--set",
                    f"trainer.steps={checkpoint.step_of(saved[-1]) + 1}")
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-2000:]


@pytest.mark.parametrize("how", ["interrupt", "kill"])
def test_a_checkpoint_cut_short_is_absent_never_torn(tmp_path, how):
    """A checkpoint being written when its process is interrupted (KeyboardInterrupt: its folder is
    removed) or killed (its temporary folder stays, and nothing reads it) leaves the last whole one
    as the latest."""
    from driver import checkpoint
    script = (f"import sys, time, numpy as np\nsys.path.insert(0, {str(ROOT)!r})\n"
              "from driver import checkpoint\nfrom experts import state_file\n"
              "from experts.records import ExpertInfo, Snapshot\n"
              "snap = lambda v: {'generator': Snapshot({'w': np.full(1000, v, np.float32)}, None, ExpertInfo(v, v))}\n"
              f"checkpoint.save({str(tmp_path)!r}, 1, snap(1))\n"
              "write = state_file.write\n"
              "def slow(*args, **kwargs):\n    hashes = write(*args, **kwargs)\n    print('writing', flush=True)\n    time.sleep(60)\n    return hashes\n"
              "state_file.write = slow\n"
              f"checkpoint.save({str(tmp_path)!r}, 2, snap(2))\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            preexec_fn=as_a_terminal_starts_it)
    assert proc.stdout.readline() == "writing\n"
    proc.send_signal(signal.SIGINT if how == "interrupt" else signal.SIGKILL)
    proc.wait(timeout=30)
    left = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert left == (["step_000001"] if how == "interrupt" else ["step_000001", "step_000002.tmp"])
    assert checkpoint.verify(checkpoint.latest(tmp_path), ["generator"]) == 1


def test_when_ray_ends_before_the_stops_checkpoint_one_line_names_the_last_checkpoint(tmp_path):
    """SIGTERM, and at once Ray's own processes killed (as the OOM killer would): the step's
    checkpoint cannot be written; the line says so, names the last one written and its step, and
    the exit status says the run was stopped."""
    run_dir = tmp_path / "run"
    proc = start("train", *TINY, "--set", "trainer.steps=200", "--set",
                 "trainer.checkpoint_every=2", "--run-dir", str(run_dir))
    wait_for_rows(proc, run_dir, 3)
    proc.send_signal(signal.SIGTERM)
    for process in psutil.Process(proc.pid).children(recursive=True):
        if process.name() in ("raylet", "gcs_server"):
            process.kill()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    line = next(x for x in err.splitlines() if "Ray ended" in x)
    last = max(checkpoint_steps(run_dir))
    assert line.startswith("jointrl: stopped by SIGTERM, but Ray ended before the checkpoint could be written (")
    assert f"the last checkpoint is {run_dir}/checkpoints/step_{last:06d} (step {last}); resume with: jointrl " \
           f"train --resume {run_dir}" in line and last >= 2 and "Traceback" not in err


def checkpoint_steps(run_dir: Path) -> list[int]:
    return [int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*[0-9]")]


@pytest.mark.parametrize("mode", ["ray", "inline"])
def test_a_signal_while_the_run_starts_leaves_it_resumable_or_untouched_and_says_which(tmp_path, mode):
    """Sent as the command says the run begins: the run stops before its first step, with its folder
    either holding a checkpoint of step 0 (it resumes) or nothing of a run (the same command
    starts it again); never a folder that is neither."""
    run_dir = tmp_path / "run"
    args = ["train", *TINY, "--set", "trainer.steps=2", "--set", f"cluster.mode={mode}",
            "--run-dir", str(run_dir)]
    proc = start(*args)
    assert proc.stdout.readline().startswith("jointrl: run ")
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "Traceback" not in err, err[-2000:]
    if "holds no run: start it again with the same command" in out:
        assert not any((run_dir / name).exists() for name in ("config.yaml", "metrics.jsonl", "checkpoints"))
        again = start(*args[:-2], "--set", "cluster.mode=inline", *args[-2:])
    else:
        assert "before training a step" in out and checkpoint_steps(run_dir) == [0], out
        again = start("train", "--resume", str(run_dir), "--set", "cluster.mode=inline")
    _, err = again.communicate(timeout=300)
    assert again.returncode == 0 and len(rows(run_dir)) == 2, err[-2000:]


def test_a_signal_the_process_was_started_ignoring_stays_ignored():
    """`nohup` starts a run with SIGHUP ignored: a closed terminal must not stop it."""
    from driver.interrupts import Interrupts
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with Interrupts():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    finally:
        signal.signal(signal.SIGHUP, before)


def test_a_second_signal_during_a_ray_get_exits_with_that_signals_status(ray_session):
    """Ray's wait catches what the handler raises and raises a plain KeyboardInterrupt in its place
    (the CI's failure: a second SIGTERM exited 130): the run still exits 143."""
    import threading
    import ray
    from driver.interrupts import Interrupts, StopNow
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sleeper = ray.remote(num_cpus=0)(lambda: time.sleep(60)).remote()

    def twice(interrupts):  # the second once the first was handled (a wait runs handlers about once a second)
        os.kill(os.getpid(), signal.SIGTERM)
        while not interrupts.requested:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)
    stop = None
    try:
        with Interrupts() as interrupts:
            threading.Thread(target=twice, args=(interrupts,), daemon=True).start()
            ray.get(sleeper)
    except KeyboardInterrupt as stopped:  # caught here: one that left the test would end the session
        stop = stopped
    finally:
        signal.signal(signal.SIGTERM, before)
        ray.cancel(sleeper, force=True)
    assert isinstance(stop, StopNow) and stop.exit_code == 143, repr(stop)


def test_one_run_per_folder(tmp_path):
    run_dir = tmp_path / "run"
    first = start("train", *TINY, "--set", "trainer.steps=200", "--set", "cluster.mode=inline",
                  "--run-dir", str(run_dir))
    wait_for_rows(first, run_dir, 1)
    second = start("train", *TINY, "--set", "cluster.mode=inline", "--run-dir", str(run_dir))
    _, err = second.communicate(timeout=60)
    assert second.returncode == 2 and f"in use by another run (pid {first.pid} on " in err, err
    resume = start("train", "--resume", str(run_dir))
    _, err = resume.communicate(timeout=60)
    assert resume.returncode == 2 and f"pid {first.pid}" in err, err
    first.send_signal(signal.SIGTERM)
    first.communicate(timeout=60)
    assert first.returncode == 143
    again = start("train", *TINY, "--set", "cluster.mode=inline", "--run-dir", str(run_dir))
    _, err = again.communicate(timeout=60)
    assert again.returncode == 2 and "already holds" in err and f"--resume {run_dir}" in err, err


def test_runs_started_in_the_same_second_get_folders_of_their_own(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli.time, "strftime", lambda _: "20261205-080426")
    paths = [cli.run_path(None, "configs/shapes.yaml") for _ in range(3)]
    assert [str(p) for p in paths] == ["runs/shapes-20261205-080426", "runs/shapes-20261205-080426-2",
                                       "runs/shapes-20261205-080426-3"]
    assert all(p.is_dir() for p in paths) and cli.run_path("mine", "shapes") == Path("mine")


def test_a_folder_left_by_a_run_that_never_started_is_not_reused(tmp_path, capsys):
    (tmp_path / "config.yaml").write_text("trainer: {steps: 1}\n")
    assert cli.main(["train", "--config", "shapes-tiny", "--run-dir", str(tmp_path)]) == 2
    assert "stopped before its first step" in capsys.readouterr().err


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A short finished run (inline), trained through the CLI."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    assert cli.main(["train", "--config", "shapes-tiny", "--set", "trainer.steps=2", "--set", "cluster.mode=inline",
                     "--set", "evaluation.per_category=2", "--run-dir", str(run_dir)]) == 0
    return run_dir


@pytest.mark.parametrize("key", ["experts.text_encoder.n_layers=3", "experts.text_encoder.n_heads=2",
                                 "trainer.seed=7"])
def test_resume_refuses_what_would_change_the_weights_and_saves_nothing(finished, capsys, key):
    """The frozen text encoder and the seed are in no checkpoint: the config says what they were."""
    saved = (finished / "config.yaml").read_bytes()
    assert cli.main(["train", "--resume", str(finished), "--set", "trainer.steps=4", "--set", key]) == 2
    err = capsys.readouterr().err
    assert key.split("=")[0] in err and err.count("\n") == 1, err
    assert (finished / "config.yaml").read_bytes() == saved


def test_eval_applies_set_on_the_run_and_refuses_unknown_keys(finished, capsys):
    assert cli.main(["eval", str(finished), "--set", "totally.bogus=1"]) == 2
    assert "totally" in capsys.readouterr().err
    assert cli.main(["eval", str(finished), "--set", "evaluation.refine=false",
                     "--set", "evaluation.per_category=1"]) == 0
    report = json.loads((finished / "eval.json").read_text())["sets"]
    assert all(set(s) == {"unrefined"} for s in report.values())
    assert all(len(s["unrefined"]["image/strict"]) == 7 for s in report.values())  # six tags and overall
    assert "held_out" in capsys.readouterr().out


def test_report_of_a_run_without_checkpoints_draws_its_curves_and_says_why_no_samples(finished, tmp_path, capsys):
    run_dir = tmp_path / "crashed"
    run_dir.mkdir()
    for name in ("config.yaml", "metrics.jsonl"):
        (run_dir / name).write_bytes((finished / name).read_bytes())
    assert cli.main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert str(run_dir / "report" / "rewards.png") in out and "no samples" in out and "no checkpoints" in out


@pytest.mark.parametrize("args, named", [
    (["train", "--set", "trainer.steps.x=1"], "trainer.steps.x"),
    (["train", "--set", "experts.refiner_0=5"], "refiner_0"),
    (["train", "--set", "experts.refiner_0.lr=.inf"], "experts.refiners.0.lr"),
    (["train", "--set", "algorithm.group_size=100000"], "algorithm.group_size"),
    (["train", "--set", "task.image_size=4096"], "task.image_size"),
    (["train", "--run-dir", "/proc/no/such/place"], "/proc/no/such/place"),
])
def test_each_user_error_is_one_paragraph_and_exit_2(args, named, tmp_path, capsys):
    assert cli.main([args[0], "--config", "shapes-tiny", *args[1:]]) == 2
    err = capsys.readouterr().err
    assert named in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_a_run_dir_that_is_a_file_and_an_out_that_is_a_folder_are_refused(finished, tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert cli.main(["train", "--config", "shapes-tiny", "--run-dir", str(a_file)]) == 2
    assert str(a_file) in capsys.readouterr().err
    assert cli.main(["sample", str(finished), "--prompt", "a red circle", "--out", str(tmp_path)]) == 2
    assert f"--out '{tmp_path}' is a folder" in capsys.readouterr().err


def test_a_full_disk_leaves_the_last_checkpoint_whole_and_no_temporary_folder(tmp_path):
    import numpy as np

    from driver import checkpoint
    from experts.records import ExpertInfo, Snapshot
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        small = {"generator": Snapshot({"w": np.ones(1000, np.float32)}, None, ExpertInfo(1, 0))}
        checkpoint.save(disk, 1, small)
        large = {"generator": Snapshot({"w": np.ones(4 << 20, np.float32)}, None, ExpertInfo(2, 1))}
        with pytest.raises(OSError):
            checkpoint.save(disk, 2, large)
        assert [p.name for p in (disk / "checkpoints").iterdir()] == ["step_000001"]
        assert checkpoint.verify(checkpoint.latest(disk), ["generator"]) == 1
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_a_step_bigger_than_the_clusters_memory_is_refused_once_connected(monkeypatch):
    import ray

    from common.config import SettingError
    from driver.preflight import fits_cluster
    config = make_config("algorithm.group_size=64", preset="shapes-tiny")
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0, "memory": 2.0 ** 30})
    fits_cluster(config)  # a few MB: it fits
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0, "memory": 2.0 ** 20})
    with pytest.raises(SettingError, match="the Ray cluster has 0.0 GiB"):
        fits_cluster(config)


def test_sample_draws_many_images_in_parts_the_same_as_at_once_and_refuses_too_many(finished, tmp_path, capsys):
    import numpy as np

    from driver.checkpoint import pipeline_at
    from driver.preflight import run_config
    from tasks.base import TextPrompt
    _, pipeline = pipeline_at(finished, run_config(finished, "--run"))
    prompts = [TextPrompt("a red circle")] * 6
    whole = pipeline.draw(prompts, refine=True, tag="t")
    parts = [pipeline.draw(prompts[i:i + 4], refine=True, tag="t", first=i) for i in (0, 4)]
    np.testing.assert_allclose(np.concatenate([p["images"] for p in parts]), whole["images"], atol=1e-5)
    assert [r for p in parts for r in p["refinements"]] == whole["refinements"]
    assert cli.main(["sample", str(finished), "--prompt", "a red circle", "-n", "70",
                     "--out", str(tmp_path / "many.png")]) == 0
    assert (tmp_path / "many.png").is_file()
    assert cli.main(["sample", str(finished), "--prompt", "a red circle", "-n", str(10 ** 9)]) == 2
    assert "-n 1000000000" in capsys.readouterr().err
