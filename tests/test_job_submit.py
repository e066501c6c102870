"""`ray job submit` against a head started with `ray start --head`: the repo ships as the job's
working directory (nothing installed on the cluster beyond its Python environment), the job trains
and its metrics are where the entrypoint said. The head is stopped
at the end (its whole process group), leaving the tests' own Ray alone. The job API listens on
127.0.0.1 only."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import as_a_terminal_starts_it

pytestmark = pytest.mark.cluster  # its tests start the command in a process of its own, or a Ray cluster

ROOT = Path(__file__).resolve().parents[1]
JOB_STEPS = 2
# The jobs train one refiner: how a job is submitted, stopped or attached does not depend on the
# number of experts, and each refiner is one more actor process to start.
TINY = "--config shapes-tiny --set experts.n_refiners=1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def own_ports() -> list[str]:
    """Free ports for every service a head starts whose default port would collide with another
    Ray on the machine (the tests' own runs beside it)."""
    flags = ("dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
             "metrics-export-port", "ray-client-server-port")
    return [f"--{flag}={free_port()}" for flag in flags]


def start_head(flags: list[str], env: dict, log: Path) -> subprocess.Popen:
    """`ray start --head --block` with `flags`, the venv's Python first on PATH (as in an image), on
    free ports for every agent, in a process group of its own so `stop_head` ends all of it."""
    env = {**env, "PATH": f"{Path(sys.executable).parent}:{env['PATH']}"}
    return subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
                             "--node-ip-address=127.0.0.1", "--disable-usage-stats", *own_ports(), *flags],
                            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def stop_head(proc: subprocess.Popen) -> None:
    """SIGTERM to the head's process group, then SIGKILL to what is left of it after a few seconds
    (a `ray start --block` head takes half a minute to wind down by itself; a test's head keeps
    nothing worth the wait)."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def listens_beyond_loopback(port: int) -> bool:
    """True if something accepts connections on `port` at an address other than 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outward interface
        outward = probe.getsockname()[0]
    if outward.startswith("127."):
        return False
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((outward, port)) == 0


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """A head started as users start one, with the venv's Python first on PATH (as in an image)."""
    gcs, dashboard = free_port(), free_port()
    log = tmp_path_factory.mktemp("head") / "ray-start.log"
    proc = start_head([f"--port={gcs}", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
                       "--include-dashboard=true", "--num-cpus=2"],
                      {**os.environ, "RAY_JOB_STOP_WAIT_TIME_S": "60"}, log)  # `ray job stop`'s grace before SIGKILL
    url = f"http://127.0.0.1:{dashboard}"
    from ray.job_submission import JobSubmissionClient
    token_file = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token"))
    client, deadline = None, time.monotonic() + 120
    while client is None:
        try:  # the head writes the token file when it first starts
            client = JobSubmissionClient(url, headers={"Authorization": f"Bearer {token_file.read_text().strip()}"})
        except Exception:  # the dashboard is still starting
            if time.monotonic() > deadline or proc.poll() is not None:
                os.killpg(proc.pid, signal.SIGKILL)
                pytest.fail(f"the head did not come up: {log.read_text()[-3000:]}")
            time.sleep(1)
    yield {"client": client, "url": url, "dashboard_port": dashboard, "gcs_port": gcs}
    stop_head(proc)


def submit(client, entrypoint: str):
    """The job's id once the head's agent takes it (it may still be starting)."""
    deadline = time.monotonic() + 300
    while True:
        try:
            return client.submit_job(entrypoint=entrypoint, entrypoint_num_cpus=0, runtime_env={
                "working_dir": str(ROOT), "excludes": [".git", ".venv", "runs", "bench/results"]})
        except RuntimeError as e:  # "No available agent to submit job": the head's agent is still starting
            assert "try again" in str(e) and time.monotonic() < deadline, e
            time.sleep(1)


def test_a_submitted_job_trains_and_writes_its_metrics(head, tmp_path):
    from ray.job_submission import JobStatus
    run_dir = tmp_path / "job-run"
    client = head["client"]
    job = submit(client, f"python -m driver train {TINY} --set trainer.steps={JOB_STEPS} --run-dir {run_dir}")
    deadline = time.monotonic() + 300
    while (status := client.get_job_status(job)) not in {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}:
        assert time.monotonic() < deadline, client.get_job_logs(job)[-3000:]
        time.sleep(1)
    logs = client.get_job_logs(job)
    assert status == JobStatus.SUCCEEDED, logs[-3000:]
    assert "jointrl: done, 2 steps" in logs
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(JOB_STEPS))
    assert all(r["version/generator"] == r["step"] + 1 for r in rows)
    assert (run_dir / "checkpoints" / f"step_{JOB_STEPS:06d}" / "manifest.json").is_file()


def test_ray_job_stop_checkpoints_the_last_completed_step(head, tmp_path):
    from ray.job_submission import JobStatus
    run_dir, client = tmp_path / "stopped-job", head["client"]
    job = submit(client, f"python -m driver train {TINY} --set trainer.steps=500 --run-dir {run_dir}")
    deadline = time.monotonic() + 300
    while not (run_dir / "metrics.jsonl").is_file() or len((run_dir / "metrics.jsonl").read_text().splitlines()) < 2:
        assert time.monotonic() < deadline and client.get_job_status(job) in {JobStatus.PENDING, JobStatus.RUNNING}, \
            client.get_job_logs(job)[-3000:]
        time.sleep(0.5)
    client.stop_job(job)
    while client.get_job_status(job) not in {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    logs = client.get_job_logs(job)
    assert "stopped by SIGTERM after step" in logs and f"resume with: jointrl train --resume {run_dir}" in logs, \
        logs[-3000:]
    done = len((run_dir / "metrics.jsonl").read_text().splitlines())
    assert (run_dir / "checkpoints" / f"step_{done:06d}" / "manifest.json").is_file()


def test_a_client_without_token_auth_is_told_what_it_needs(head, tmp_path):
    # Ray retries a refused connection once a second, 20 times by default: 2 tell the same story
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_NUM_REDIS_GET_RETRIES": "2"}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "-m", "driver", "train", "--config", "shapes-tiny", "--set",
                           f"cluster.address=127.0.0.1:{head['gcs_port']}", "--run-dir", str(tmp_path / "run")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "RAY_AUTH_MODE=token" in done.stderr and "Traceback" not in done.stderr, \
        done.stderr[-3000:]


def test_the_dashboard_and_job_api_listen_on_loopback_only(head):
    """Ray 2.60 binds its GCS and raylet ports on every interface whatever --node-ip-address says
    (token authentication guards them); the dashboard and job API follow --dashboard-host."""
    assert not listens_beyond_loopback(head["dashboard_port"])


def test_a_run_attached_to_a_cluster_stops_on_a_signal_to_its_group_and_checkpoints(head, tmp_path):
    """A run attached to a cluster it did not start (RAY_ADDRESS): the cluster's processes are not
    the command's, so a signal to the command's process group reaches the command alone, which
    stops the run after the step under way and checkpoints it."""
    run_dir = tmp_path / "attached"
    env = {**os.environ, "RAY_ADDRESS": f"127.0.0.1:{head['gcs_port']}", "RAY_AUTH_MODE": "token"}
    proc = subprocess.Popen([sys.executable, "-m", "driver", "train", *TINY.split(), "--set", "trainer.steps=500",
                             "--run-dir", str(run_dir)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=as_a_terminal_starts_it)
    metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 300
    while not metrics.is_file() or len(metrics.read_text().splitlines()) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and f"resume with: jointrl train --resume {run_dir}" in out, err[-3000:]
    done = len(metrics.read_text().splitlines())
    assert (run_dir / "checkpoints" / f"step_{done:06d}" / "manifest.json").is_file()
