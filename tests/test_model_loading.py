"""Loading real models as a GPU node does (common/hub.py, common/loading.py), checked without a hub:
the configured revision is the one fetched and every loader reads the fetched folder; N processes
of a node asking for one hub model at once make one download; the client's HF_* settings reach a
Ray actor; every pretrained model is read by from_pretrained straight onto its device and kept as
loaded. A model that cannot be had is refused before anything starts, naming its key; one that
fails to load inside an actor anyway is one paragraph naming the actor and the key."""
import http.server
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from common.config import SettingError
import common.hub as hub
from common.hub import local_model
from driver.preflight import load_config
from tests.conftest import make_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    """The hub client's downloads, recorded as (repo, revision) and answered with tiny models' folders."""
    import huggingface_hub
    from diffusers import DiffusionPipeline
    folders = {"org/refiner": local_model("tiny:qwen2"), "org/pipeline": local_model("tiny:sd3"),
               "org/clip": local_model("tiny:clip"), "org/processor": local_model("tiny:clip")}
    asked = []

    def snapshot_download(repo, revision=None, allow_patterns=None, **_):
        asked.append(("snapshot", repo, revision, tuple(allow_patterns)))
        return folders[repo]

    def pipeline_download(repo, revision=None, **_):
        asked.append(("pipeline", repo, revision, ()))
        return folders[repo]

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    monkeypatch.setattr(DiffusionPipeline, "download", pipeline_download)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "_fetched", {})
    return asked


def test_each_model_is_fetched_at_its_revision_and_loaded_from_the_fetched_folder(fake_hub):
    """Hub ids with revisions for a refiner, the generator (its transformer and its front end) and a
    reward model: each is fetched once at its revision, and the models load (no loader asked the hub
    itself: the ids name no real repository and this machine reaches none)."""
    from experts.frontend import build_frontend
    from experts.kinds import build_model
    from tasks.rewards.term import build_scorer
    config = make_config(
        "experts.refiner_0.model={kind: hf_causal_lm, path: org/refiner, revision: r1, answer_tag: null}",
        "experts.generator.model={kind: diffusers_flow, path: org/pipeline, revision: v2, max_sequence_length: 8}",
        "reward.terms={clip: {fn: clip_score, model: org/clip, revision: c3}}", "experts.generator.owns=null",
        preset="shapes-tiny")
    refiner, velocity = build_model(config, "refiner_0"), build_model(config, "generator")
    frontend, scorer = build_frontend(config), build_scorer(config.reward.terms["clip"], torch.device("cpu"))
    assert refiner.lm is not None and velocity.transformer is not None and frontend.vae is not None
    assert scorer.clip.model is not None
    fetched = {(repo, revision) for _, repo, revision, _ in fake_hub}
    assert fetched == {("org/refiner", "r1"), ("org/pipeline", "v2"), ("org/clip", "c3")}
    assert ("pipeline", "org/pipeline", "v2", ()) in fake_hub  # a pipeline's components, as diffusers picks them
    asked = len(fake_hub)
    build_model(config, "refiner_0")
    assert len(fake_hub) == asked  # fetched once per process, however many loaders ask


HUB_CONFIG = ["experts.refiner_0.model={kind: hf_causal_lm, path: org/refiner, revision: r1}",
              "experts.generator.model={kind: diffusers_flow, path: org/pipeline, revision: v2}",
              "reward.terms={pick: {fn: pickscore, model: org/clip, revision: c3, processor: org/processor}}",
              "experts.generator.owns=null"]


def test_jointrl_download_fetches_every_hub_model_a_config_names(fake_hub, capsys):
    """`jointrl download` (what a GPU user runs before submitting a job): each hub model once at its
    revision, a processor of another repo without its weights; `--list` prints the `hf download` lines."""
    import driver.cli as cli
    sets = [f"--set={s}" for s in HUB_CONFIG]
    assert cli.main(["download", "--config", "shapes-tiny", "--list", *sets]) == 0
    listed = capsys.readouterr().out
    assert not fake_hub and listed.count("hf download ") == 4, listed
    assert 'hf download org/refiner --revision r1 --include "*.json"' in listed
    assert cli.main(["download", "--config", "shapes-tiny", *sets]) == 0
    assert capsys.readouterr().out.count("jointrl: fetched ") == 4
    weights = {(repo, revision, any("safetensors" in p for p in patterns) or kind == "pipeline")
               for kind, repo, revision, patterns in fake_hub}
    assert {w for w in weights if w[2]} == {("org/refiner", "r1", True), ("org/pipeline", "v2", True),
                                            ("org/clip", "c3", True)}
    assert {(r, v) for r, v, _ in weights} == {("org/refiner", "r1"), ("org/pipeline", "v2"), ("org/clip", "c3"),
                                               ("org/processor", None)}


# each process: wait until every process has started, then ask for the model at once
LOADER = """
import sys, time
from pathlib import Path
import common.hub as hub
shared, n = Path(sys.argv[1]), int(sys.argv[2])

def download(repo, revision, weights):  # as the hub client: a file already in the cache is not downloaded again
    folder = shared / "snapshot"
    if not (folder / "weights.safetensors").exists():
        time.sleep(0.3)
        folder.mkdir(exist_ok=True)
        (folder / "weights.safetensors").write_text(f"{repo}@{revision}")
        with open(shared / "downloads.log", "a") as log:
            log.write(f"{repo}@{revision}\\n")
    return str(folder)

hub.download = download
(shared / f"ready-{sys.argv[3]}").touch()
while len(list(shared.glob("ready-*"))) < n:
    time.sleep(0.01)
folder = hub.local_model("org/model", "abc123")
print((Path(folder) / "weights.safetensors").read_text())
"""


def test_concurrent_loaders_on_a_node_download_a_model_once(tmp_path):
    """Four processes of one node (one HF cache) ask for the same hub model at the same moment: one
    downloads it under the cache's lock, the others wait and read the cached files."""
    n = 4
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "PYTHONPATH": str(ROOT)}
    loaders = [subprocess.Popen([sys.executable, "-c", LOADER, str(tmp_path), str(n), str(i)], env=env, cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(n)]
    outputs = [loader.communicate(timeout=60) for loader in loaders]
    assert all(loader.returncode == 0 for loader in loaders), [err for _, err in outputs]
    assert [out.strip() for out, _ in outputs] == ["org/model@abc123"] * n  # each read the whole model
    assert (tmp_path / "downloads.log").read_text().splitlines() == ["org/model@abc123"]
    assert (tmp_path / "hub" / ".locks" / "jointrl" / "org--model.lock").exists()


def test_the_clients_hub_settings_reach_every_actor(ray_session, monkeypatch, tmp_path):
    """HF_* settings set in the client after Ray started (so no worker inherits them) reach an actor
    the run spawns, as a node started by `ray start` needs them."""
    import ray

    from cluster.runtime import Runtime
    settings = {"HF_TOKEN": "hf_not_a_real_token", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
                "HF_ENDPOINT": "https://hub.example"}
    for key, value in settings.items():
        monkeypatch.setenv(key, value)

    class Probe:
        def env(self, keys):
            return {k: os.environ.get(k) for k in keys}

    probe = Runtime("ray", "test-hub-env").spawn(Probe, name="probe")
    try:
        assert ray.get(probe.env.remote(list(settings))) == settings
    finally:
        ray.kill(probe)


def test_pretrained_models_load_straight_onto_their_device(monkeypatch):
    """Every transformers and diffusers model a rollout worker loads (refiners, the generator's
    transformer, its text encoders and VAE, every reward model) is read by from_pretrained onto the
    device asked for (device_map: on a GPU, each tensor goes from the file to the GPU, no whole host
    copy first), and the worker holds the very tensors loaded (no second copy made after). On a CPU
    machine the device asked for is the host: what shows is the loading call and the tensors kept."""
    from diffusers import ModelMixin
    from transformers import PreTrainedModel

    from experts.pipeline import RolloutPipeline
    loaded = []

    def spy(base):
        original = base.from_pretrained.__func__

        def from_pretrained(cls, *args, **kwargs):
            model = original(cls, *args, **kwargs)
            loaded.append((cls.__name__, kwargs.get("device_map"), model, {p.data_ptr() for p in model.parameters()}))
            return model
        monkeypatch.setattr(base, "from_pretrained", classmethod(from_pretrained))

    spy(PreTrainedModel)
    spy(ModelMixin)
    device = torch.device("cpu")
    pipeline = RolloutPipeline(make_config(preset="prompts-tiny"), device=device)
    names = sorted(name for name, *_ in loaded)
    assert {"Qwen2ForCausalLM", "SD3Transformer2DModel", "CLIPTextModelWithProjection", "AutoencoderKL",
            "CLIPModel", "Owlv2ForObjectDetection", "VisionEncoderDecoderModel",
            "Qwen2VLForConditionalGeneration"} <= set(names), names
    assert all(device_map == device for _, device_map, *_ in loaded), [(n, d) for n, d, *_ in loaded]
    for name, _, model, pointers in loaded:  # (a LoRA adapter adds parameters of its own)
        assert pointers <= {p.data_ptr() for p in model.parameters()}, f"{name} was copied after loading"
    held = {id(pipeline.models["generator"].transformer), id(pipeline.frontend.vae),
            *(id(m.lm.get_base_model() if hasattr(m.lm, "get_base_model") else m.lm)
              for e, m in pipeline.models.items() if e != "generator")}
    assert held <= {id(model) for _, _, model, _ in loaded}


# A model that cannot be had is refused before anything starts; one that fails to load anyway is one paragraph.

HUB_MODELS = ["experts.refiner_0.model={kind: hf_causal_lm, path: org/refiner, answer_tag: null}",
              "reward.terms={pick: {fn: pickscore, model: 'tiny:clip', processor: org/processor}}",
              "algorithm.credit=shared", "experts.generator.owns=null"]


@pytest.fixture
def no_hub(monkeypatch, tmp_path):
    """The hub as this machine sees it: nothing answers at its endpoint (a port nothing listens on),
    HF_HUB_OFFLINE unset, and an empty cache of the test's own."""
    from huggingface_hub import constants
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "_fetched", {})
    return constants


def cache_model(cache: Path, repo: str, source: str, weights: bool = True) -> Path:
    """`source`'s files laid out as the Hugging Face cache holds hub model `repo` at its default
    branch (as `jointrl download` leaves it), without its weights unless `weights`."""
    root, commit = cache / f"models--{repo.replace('/', '--')}", "0" * 40
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    snapshot = root / "snapshots" / commit
    shutil.copytree(source, snapshot, dirs_exist_ok=True,
                    ignore=None if weights else shutil.ignore_patterns("*.safetensors"))
    return snapshot


@pytest.mark.parametrize("unreachable", ["offline", "refused", "silent"])
def test_a_hub_model_not_in_the_cache_is_refused_when_the_hub_cannot_be_reached(unreachable, no_hub, monkeypatch,
                                                                               tmp_path, capsys):
    """Before anything starts, exit 2, one paragraph naming each key (a term's option among them) and
    the `jointrl download` line that fetches the models: whether HF_HUB_OFFLINE is set, the endpoint
    refuses, or it never answers (one request, a short timeout)."""
    import driver.cli as cli
    if unreachable == "offline":
        monkeypatch.setattr(no_hub, "HF_HUB_OFFLINE", True)
    silent = socket.socket()
    if unreachable == "silent":  # takes the connection, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        monkeypatch.setattr(no_hub, "ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
        monkeypatch.setattr(hub, "HUB_TIMEOUT_S", 0.5)
    start = time.monotonic()
    with silent:
        code = cli.main(["train", "--config", "shapes-tiny", *(f"--set={s}" for s in HUB_MODELS),
                         "--run-dir", str(tmp_path / "run")])
    took, err = time.monotonic() - start, capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "experts.refiner_0.model.path: 'org/refiner' is neither a local folder, a tiny:<kind> model nor in " \
           "this machine's Hugging Face cache; reward.terms.pick.processor: 'org/processor' is neither" in err
    assert {"offline": "(HF_HUB_OFFLINE is set)", "refused": "ConnectError", "silent": "Timeout"}[unreachable] in err
    assert "`jointrl download --config shapes-tiny --set 'experts.refiner_0.model={kind: hf_causal_lm" in err
    assert took < 5 and not (tmp_path / "run").exists()


def test_a_cached_hub_model_or_a_hub_that_answers_passes_preflight(no_hub, monkeypatch, tmp_path):
    """In the cache (with the weights a load reads), a hub model needs no hub, and loads from there;
    one the cache lacks is left to the actors to fetch when the hub answers."""
    cache = Path(no_hub.HF_HUB_CACHE)
    cache_model(cache, "org/processor", local_model("tiny:clip"), weights=False)  # a processor: no weights read
    cache_model(cache, "org/refiner", local_model("tiny:qwen2"), weights=False)
    with pytest.raises(SettingError, match=r"experts\.refiner_0\.model\.path: 'org/refiner' is neither") as refused:
        load_config("shapes-tiny", HUB_MODELS)
    assert "reward.terms.pick.processor" not in str(refused.value)
    snapshot = cache_model(cache, "org/refiner", local_model("tiny:qwen2"))
    monkeypatch.setattr(no_hub, "HF_HUB_OFFLINE", True)
    load_config("shapes-tiny", HUB_MODELS)
    assert local_model("org/refiner") == str(snapshot)  # what an actor then reads, asking no hub

    class Hub(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass
    monkeypatch.setattr(no_hub, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(no_hub, "HF_HUB_CACHE", str(tmp_path / "empty"))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hub) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        monkeypatch.setattr(no_hub, "ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
        load_config("shapes-tiny", HUB_MODELS)
        server.shutdown()


def test_config_show_needs_no_hub(no_hub, monkeypatch, capsys):
    import driver.cli as cli
    monkeypatch.setattr(no_hub, "HF_HUB_OFFLINE", True)
    assert cli.main(["config", "show", "--config", "gpu"]) == 0
    assert "stabilityai/stable-diffusion-3.5-medium" in capsys.readouterr().out


def unloadable(tmp_path: Path) -> Path:
    """A folder preflight takes for a saved model (it holds a config.json) that no loader can read."""
    folder = tmp_path / "unloadable"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "no_such_architecture", "architectures": ["NoSuchModel"]}')
    return folder


@pytest.mark.cluster  # it starts the command, or a Ray, in a process of its own
def test_a_model_that_fails_to_load_in_an_actor_is_one_paragraph_naming_the_actor_and_key(tmp_path):
    """A reward model that passes preflight but cannot be loaded kills the rollout worker as it
    starts: `jointrl train` (on a Ray of its own) prints one paragraph (the actor, the key, the
    cause), exit 2, at once (nobody waits for an actor Ray will not restart); Ray's tracebacks are in
    the run's log, and nothing of a run is left to refuse a second try in the folder."""
    bad, run = unloadable(tmp_path), tmp_path / "unloadable-run"
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "driver", "train", "--config", "shapes-tiny",
                           "--set", f"reward.terms={{clip: {{fn: clip_score, model: {bad}}}}}",
                           "--set", "algorithm.credit=shared", "--set", "experts.generator.owns=null",
                           "--set", "experts.n_refiners=1", "--run-dir", str(run)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    took, err = time.monotonic() - start, done.stderr
    assert done.returncode == 2 and err.count("\n") == 1, err
    assert err.startswith(f"jointrl: the run could not start: actor {run.name}/rollout/0 failed as it started: "
                          f"reward.terms.clip.model: cannot load '{bad}' (ValueError: "), err
    assert f"Change reward.terms.clip.model and start again. The full traceback is in {run / 'ray.log'}." in err
    log = (run / "ray.log").read_text()
    assert "Traceback" in log and "ActorDiedError" in log and "ModelLoadError" in log
    assert sorted(p.name for p in run.iterdir()) == [".lock", "ray.log"] and took < 60  # (the lock is let go)


def test_a_reward_actor_that_cannot_load_its_model_stops_the_start(ray_session, tmp_path, capsys):
    """A term scored by a pool of reward actors: the run waits for them to start, so one that cannot
    load its model is said as the actor's failure (not as the reward failing step after step), and
    the run's actors are gone. (On the tests' shared Ray, the actors' own lines reach stderr too.)"""
    import ray

    import driver.cli as cli
    bad, run = unloadable(tmp_path), tmp_path / "unloadable-pool"
    code = cli.main(["train", "--config", "shapes-tiny", "--set", f"reward.terms={{clip: {{fn: clip_score, "
                     f"model: {bad}, actors: 1}}}}", "--set", "algorithm.credit=shared", "--set",
                     "experts.generator.owns=null", "--set", "experts.n_refiners=1", "--run-dir", str(run)])
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("jointrl:")]
    assert code == 2 and len(said) == 1, said
    assert said[0].startswith(f"jointrl: the run could not start: actor {run.name}/reward/clip/0 failed as it "
                              f"started: reward.terms.clip.model: cannot load '{bad}'"), said
    deadline = time.monotonic() + 10  # the actors the driver owned die with it, as Ray gets to them
    while left := [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["name"].startswith(f"{run.name}/")]:
        assert time.monotonic() < deadline, left
        time.sleep(0.1)


def test_an_experts_model_that_fails_to_load_is_named_by_its_path_key(tmp_path, capsys):
    import driver.cli as cli
    bad = unloadable(tmp_path)
    assert cli.main(["train", "--config", "shapes-tiny", "--set", "cluster.mode=inline",
                     "--set", f"experts.refiner_0.model={{kind: hf_causal_lm, path: {bad}}}",
                     "--run-dir", str(tmp_path / "run")]) == 2
    last = capsys.readouterr().err.splitlines()[-1]  # (inline, transformers' own warning comes before)
    assert last.startswith("jointrl: the run could not start: actor RolloutWorker failed as it started: "
                           f"experts.refiner_0.model.path: cannot load '{bad}' (ValueError: "), last


def test_a_start_failure_is_the_users_where_a_setting_is_to_blame_and_survives_rays_text():
    """A refused setting (cluster.sync) is the user's, exit 2, raised here or through a Ray call;
    running out of memory is not (exit 1); a failure marked in an error's text (as Ray keeps an
    actor's constructor error, nested in its callers' errors) is found again whole."""
    import pickle

    from ray.exceptions import RayTaskError

    from cluster.collective import CollectiveRefused
    from cluster.startup import ActorStartFailed, StartFailure, start_failure
    refused = CollectiveRefused("NCCL refuses two members of a group on one GPU")
    through_ray = RayTaskError("publish", "Traceback (most recent call last): ...", refused).as_instanceof_cause()
    for error in (refused, through_ray):
        failure = StartFailure.of(error, "run/driver")
        assert (failure.actor, failure.key, failure.exit_code) == ("run/driver", "cluster.sync", 2)
        assert failure.cause == "NCCL refuses two members of a group on one GPU"
    oom = StartFailure.of(RuntimeError("CUDA out of memory.\nTried to allocate 2.00 GiB"), "run/expert/generator")
    assert oom.key is None and oom.exit_code == 1
    assert oom.cause == "out of memory (RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB)"
    marked = ActorStartFailed(StartFailure("run/rollout/0", "reward.terms.ocr.model: cannot load 'm' (x)",
                                           "reward.terms.ocr.model"))
    nested = RuntimeError(f"The actor died because of an error raised in its creation task\n  File ...\n"
                          f"cluster.startup.ActorStartFailed: {marked}\n\nDuring handling ...")
    assert start_failure(nested) == StartFailure.of(nested, "run/driver") == marked.failure
    assert pickle.loads(pickle.dumps(marked)).failure == marked.failure and start_failure(ValueError("x")) is None
