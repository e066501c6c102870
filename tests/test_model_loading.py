"""Loading real models as a GPU node does (common/hub.py, common/loading.py), checked without a hub:
the configured revision is the one fetched and every loader reads the fetched folder; N processes
of a node asking for one hub model at once make one download; the client's HF_* settings reach a
Ray actor; every pretrained model is read by from_pretrained straight onto its device and kept as
loaded."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import common.hub as hub
from common.hub import local_model
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
