"""A reward served elsewhere: `jointrl serve-reward` serves a term over HTTP and a run's `fn: http`
term scores with it, step for step as the term in process; a server that dies is retried and then
counted, one that answers garbage is named, a URL that does not answer stops the run at preflight,
and the server's own refusals (protocol, size, token) are one line each."""
import http.server
import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest

from common.config import SettingError
from driver import cli
from driver.commands.score import term_config
from driver.commands.serve_reward import server_for
from tasks.base import Refinement, TextPrompt
from tasks.rewards.http import HttpOptions, HttpReward
from tests.conftest import assert_same_training, read_metrics, trained_inline


@pytest.fixture(scope="module")
def served_clip_score():
    """prompts-tiny's clip_score served by the command in a process of its own, one torch thread (as
    the run's scorer computes: the same reductions, the same numbers)."""
    process = subprocess.Popen([sys.executable, "-c", "import sys; from driver.cli import main; sys.exit(main())",
                                "serve-reward", "--term", "clip_score", "--config", "prompts-tiny", "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    line = process.stdout.readline()
    assert "serving reward term clip_score" in line, line
    yield line.split(" at ")[1].split()[0]
    process.terminate()
    process.wait(timeout=30)


def in_process(term: str, config: str = "prompts-tiny", max_mb: float = 256.0, host: str = "127.0.0.1"):
    """The term `term` of `config` served from a thread of this process: (its URL, the server)."""
    config, found = term_config(config, [], term)
    server = server_for(config, term, found, host=host, port=0, max_request_mb=max_mb)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server


def served(url: str, **options) -> HttpReward:
    return HttpReward(HttpOptions(url=url, **options), device=None)


PROMPTS = [TextPrompt("a red cat"), TextPrompt("two dogs", {"tag": "counting"})]
REFINED = [{"refiner_0": Refinement("a red cat, detailed", True, None)}, {}]


def images(n: int = 2) -> np.ndarray:
    return np.random.default_rng(0).uniform(-1, 1, (n, 3, 16, 16)).astype(np.float32)


@pytest.mark.cluster  # the term is served by the command in a process of its own
def test_a_run_whose_term_is_served_equals_the_run_scoring_it_in_process(served_clip_score, tmp_path):
    here, there = tmp_path / "here", tmp_path / "there"
    trained_inline(here, "prompts-tiny", 2)
    trained_inline(there, "prompts-tiny", 2,
                   f"reward.terms.clip_score={{fn: http, url: '{served_clip_score}', weight: 0.25}}")
    a, b = read_metrics(here), read_metrics(there)
    assert all(np.isfinite(r["reward/clip_score"]) and r["faults/reward_error"] == 0 for r in b)
    assert_same_training(a, b, tol=0.0)


def test_text_terms_read_the_refinements_and_prompts_as_sent():
    url, server = in_process("length")
    try:
        from tasks.rewards import resolve
        config, term = term_config("prompts-tiny", [], "length")
        own = resolve(term.fn)(term.options(), None)
        assert np.array_equal(served(url)(images(), PROMPTS, REFINED), own(images(), PROMPTS, REFINED))
    finally:
        server.shutdown()


def test_the_server_refuses_what_is_not_the_protocol_in_one_line():
    url, server = in_process("length", max_mb=0.001)
    try:
        for path, body, code, says in [("/score", b'{"prompts": 3}', 400, "a list 'prompts'"),
                                       ("/score", b"not json", 400, "Expecting value"),
                                       ("/score", json.dumps({"prompts": [{"text": "a"}], "images": [["!!"]]}).encode(),
                                        400, "base64 PNGs"),
                                       ("/score", b"x" * 2000, 413, "at most 1048 (--max-request-mb)"),
                                       ("/nowhere", b"{}", 404, "POST /score")]:
            with pytest.raises(urllib.error.HTTPError) as caught:
                urllib.request.urlopen(urllib.request.Request(url + path, data=body, method="POST"), timeout=10)
            reason = json.loads(caught.value.read())["error"]
            assert caught.value.code == code and says in reason and "\n" not in reason, (path, reason)
    finally:
        server.shutdown()


class Garbage(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b'{"scores": [1.0]}')  # one score for a batch of two

    def log_message(self, *args):
        pass


def test_a_server_answering_garbage_is_named_and_a_dead_one_is_retried_then_raises():
    garbage = http.server.HTTPServer(("127.0.0.1", 0), Garbage)
    threading.Thread(target=garbage.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{garbage.server_address[1]}"
    try:
        with pytest.raises(ValueError, match=f"the reward server at {url} answered .*not .*2 numbers or null"):
            served(url)(images(), PROMPTS, REFINED)
    finally:
        garbage.shutdown()
        garbage.server_close()
    with pytest.raises(RuntimeError, match=f"the reward server at {url}: URLError"):
        served(url, retries=2, timeout_s=1)(images(), PROMPTS, REFINED)


def test_a_server_that_dies_mid_run_costs_the_steps_after_it_counted_as_reward_errors(tmp_path):
    url, server = in_process("clip_score")
    scorer, calls = server.scorer, []

    def once_then_gone(*args):
        calls.append(1)
        threading.Thread(target=gone).start()  # the server is gone after its first answer: connections refused
        return scorer(*args)

    def gone():
        server.shutdown()
        server.server_close()
    server.scorer = once_then_gone
    run = tmp_path / "run"
    trained_inline(run, "prompts-tiny", 3,
                   f"reward.terms.clip_score={{fn: http, url: '{url}', weight: 0.25, retries: 1, timeout_s: 5}}")
    rows = read_metrics(run)
    assert rows[0]["faults/reward_error"] == 0 and np.isfinite(rows[0]["reward/clip_score"])
    assert all(r["faults/reward_error"] > 0 for r in rows[1:]) and len(calls) == 1


def test_a_url_that_does_not_answer_stops_the_run_at_preflight(tmp_path, capsys):
    assert cli.main(["train", "--config", "prompts-tiny", "--set", "reward.terms.remote={fn: http, url: "
                     "'http://127.0.0.1:9', weight: 1.0}", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "reward.terms.remote.url: no reward server answers at http://127.0.0.1:9" in err
    assert not (tmp_path / "run").exists()


def test_a_server_off_the_loopback_needs_a_token_and_with_one_every_request_brings_it(monkeypatch):
    config, term = term_config("prompts-tiny", [], "length")
    with pytest.raises(SettingError, match="requires a bearer token: set JOINTRL_REWARD_TOKEN"):
        server_for(config, "length", term, host="0.0.0.0", port=0, max_request_mb=1.0)
    monkeypatch.setenv("JOINTRL_REWARD_TOKEN", "s3cret")
    url, server = in_process("length", host="0.0.0.0")
    try:
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(url + "/health", timeout=10)
        assert caught.value.code == 401
        assert served(url)(images(), PROMPTS, REFINED).shape == (2,)  # the client sends its JOINTRL_REWARD_TOKEN
        monkeypatch.setenv("JOINTRL_REWARD_TOKEN", "wrong")
        with pytest.raises(RuntimeError, match="HTTP 401"):
            served(url)(images(), PROMPTS, REFINED)
    finally:
        server.shutdown()


def test_a_terms_runtime_env_reaches_its_reward_actors_beside_every_actors_environment(ray_session, monkeypatch):
    import ray

    from cluster.reward_pool import spawn_pools
    from cluster.runtime import Runtime
    from tests.conftest import make_config
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a client's hub setting, which every actor is given
    config = make_config("cluster.mode=ray", "reward.terms.env={fn: tests.faulty_rewards:from_environment, weight: 0.0, "
                         "actors: 1, runtime_env: {env_vars: {JOINTRL_TERM_SCORE: '0.25'}}}", preset="shapes-tiny")
    pools = spawn_pools(config, Runtime("ray", "test-runtime-env"))
    try:
        (actor,) = pools["env"]
        assert list(ray.get(actor.score.remote(images(), PROMPTS, REFINED))) == [3.5, 3.5]
    finally:
        for actors in pools.values():
            for a in actors:
                ray.kill(a)


@pytest.mark.parametrize("sets, says", [
    (["reward.terms.env={fn: tests.faulty_rewards:from_environment, actors: 0, runtime_env: {env_vars: {A: '1'}}}"],
     "reward.terms.env.runtime_env: the term is scored by each rollout worker"),
    (["cluster.mode=inline", "reward.terms.env={fn: tests.faulty_rewards:from_environment, actors: 1, "
                             "runtime_env: {env_vars: {A: '1'}}}"], "cluster.mode=inline scores every term")])
def test_a_runtime_env_where_nothing_applies_it_is_refused(sets, says, capsys, tmp_path):
    assert cli.main(["train", "--config", "shapes-tiny", *(a for s in sets for a in ("--set", s)),
                     "--run-dir", str(tmp_path / "run")]) == 2
    assert says in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_a_served_terms_strict_correctness_is_read_where_it_has_one():
    """GenEval's strict (every clause holds) travels with its scores; a term without one serves none."""
    import torch

    from tasks.prompt_data import load_prompts
    from tasks.rewards.term import build_scorer
    url, server = in_process("geneval")
    text_url, text_server = in_process("length")
    try:
        _, term = term_config("prompts-tiny", [], "geneval")
        own = build_scorer(term, torch.device("cpu"), "geneval")
        prompts = load_prompts("configs/data/geneval-tiny-eval.jsonl")  # one of each tag, twice
        pictures, refined = images(len(prompts)), [{} for _ in prompts]
        client = served(url)
        assert client.strict is not None and served(text_url).strict is None
        strict = client.strict(pictures, prompts, refined)
        assert np.array_equal(strict, own.strict(pictures, prompts, refined)) and 0 < strict.mean() < 1
        assert np.array_equal(client(pictures, prompts, refined), own(pictures, prompts, refined))
    finally:
        server.shutdown()
        text_server.shutdown()
