"""Where a model named in the config is read from: a local folder, a hub id, or `tiny:<kind>`.

A hub id (`org/name`, at the config's `revision`) is fetched into the Hugging Face cache by one
process per node: the first to ask downloads it under a file lock in the cache, the others wait for
the lock and find every file there. Only what loading reads is fetched (a pipeline's components, a
model's configs, tokenizer and safetensors weights), and every loader then reads that local folder,
so none can reach another revision. The client's HF_* settings (token, cache, endpoint, offline)
travel to every actor with `hub_env` (cluster/runtime.py).

`tiny:<kind>` and `random:<name>` models are built on this machine (common/tiny.py).

Before a run starts, a hub id must be in this machine's cache or the hub must answer: `cached`
finds the folder a load would read without asking the hub, and `hub_unreachable` asks the hub once,
briefly (HF_HUB_OFFLINE set, or no answer within seconds, means it cannot be reached).
"""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from common.tiny import RANDOM, built_here, is_random, is_tiny, tiny_model

# what loading a transformers model reads beside its weights: configs, tokenizers, processors, chat templates
MODEL_FILES = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
_fetched: dict[tuple[str, str | None, bool], str] = {}  # (hub id, revision, weights) -> its folder, in this process


@dataclass(frozen=True)
class ModelRef:
    """A model a config names (a folder, hub id or `tiny:<kind>`), the revision to load, and whether
    its weights are read (not for a processor or tokenizer taken from a model's repo). `option`:
    the reward term option that names it (`model`, `processor`, `clip_model`, `tokenizer`); two
    options naming one model are one model."""
    name: str
    revision: str | None = None
    weights: bool = True
    option: str = field(default="model", compare=False)

    @property
    def on_hub(self) -> bool:
        return not built_here(self.name) and not Path(self.name).expanduser().is_dir()


_asking = threading.local()  # this thread's open `asked_models` lists


@contextmanager
def asked_models():
    """A list of every model `local_model` is asked for in this thread while the block runs: when
    building something that loads several fails, its last one is the model being loaded."""
    asked: list[str] = []
    stack = _asking.__dict__.setdefault("lists", [])
    stack.append(asked)
    try:
        yield asked
    finally:
        stack.remove(asked)


def local_model(spec: str, revision: str | None = None, weights: bool = True) -> str:
    """The folder to load `spec` from: a `tiny:<kind>` or `random:<name>` built first if not
    cached, a local folder as it is, a hub id fetched at `revision` (None: its default branch) into
    the Hugging Face cache, without its weights unless `weights`."""
    for asked in getattr(_asking, "lists", ()):
        asked.append(spec)
    if is_tiny(spec):
        return tiny_model(spec)
    if is_random(spec):
        from common.random_models import random_model  # torch, only for a random: model
        return str(random_model(spec[len(RANDOM):], revision))
    if Path(spec).expanduser().is_dir():
        return str(Path(spec).expanduser())
    return fetch(spec, revision, weights)


def hub_env() -> dict[str, str]:
    """This process's Hugging Face client settings (HF_TOKEN, HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE,
    HF_ENDPOINT, …: every HF_* variable set), for an actor on another node to read the same hub with
    the same token into the same cache."""
    return {k: v for k, v in os.environ.items() if k.startswith("HF_")}


def fetch(repo: str, revision: str | None, weights: bool = True) -> str:
    """The cached folder of hub model `repo` at `revision`, downloaded once per node: under a file
    lock in the Hugging Face cache, so that N actors of a node asking at once make one download (the
    first downloads; the others wait, then find every file cached and download nothing)."""
    key = (repo, revision, weights)
    if key not in _fetched:
        from filelock import FileLock
        with FileLock(lock_file(repo)):
            _fetched[key] = download(repo, revision, weights)
    return _fetched[key]


def lock_file(repo: str) -> Path:
    """The node's lock on fetching `repo`: in the Hugging Face cache the actors share (HF_HUB_CACHE)."""
    from huggingface_hub import constants
    path = Path(constants.HF_HUB_CACHE) / ".locks" / "jointrl" / f"{repo.replace('/', '--')}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def download(repo: str, revision: str | None, weights: bool = True) -> str:
    """What loading `repo` at `revision` reads, into the cache; its folder. A diffusers pipeline
    (with a model_index.json): the components its pipeline loads, as DiffusionPipeline picks them
    (a repo's single-file checkpoints and other variants are skipped). Else a transformers model:
    its configs, tokenizer and processor files and, if `weights`, its safetensors weights (its .bin
    ones where it has none). Files already cached are not downloaded again (the hub client
    compares them)."""
    from huggingface_hub import snapshot_download
    folder = snapshot_download(repo, revision=revision, allow_patterns=MODEL_FILES)
    if not weights:
        return folder
    if (Path(folder) / "model_index.json").is_file():
        from diffusers import DiffusionPipeline
        return DiffusionPipeline.download(repo, revision=revision)
    for weights in ("*.safetensors", "*.bin"):
        folder = snapshot_download(repo, revision=revision, allow_patterns=[*MODEL_FILES, weights])
        if any(Path(folder).rglob(weights)):
            break
    return folder


WEIGHTS = ("*.safetensors", "*.bin")
HUB_TIMEOUT_S = 5.0  # how long the hub may take to answer one request before it counts as unreachable


def cached(model: ModelRef) -> str | None:
    """The folder of hub model `model` in this machine's Hugging Face cache, found as a load finds it
    with no hub (its configs, and weights files if its weights are read); None if it is not there."""
    from huggingface_hub import snapshot_download
    try:
        folder = snapshot_download(model.name, revision=model.revision, allow_patterns=MODEL_FILES,
                                   local_files_only=True)
    except Exception:  # not cached, cached in part, or a name the hub client refuses
        return None
    if model.weights and not any(next(Path(folder).rglob(w), None) for w in WEIGHTS):
        return None
    return folder


def hub_unreachable(timeout_s: float | None = None) -> str | None:
    """Why the Hugging Face hub cannot be reached from here, or None if it answers: HF_HUB_OFFLINE
    set, or no HTTP answer from its endpoint (HF_ENDPOINT) within `timeout_s` (HUB_TIMEOUT_S by
    default). One request with the hub client's own session (its proxies and certificates), no
    retries, in a thread of its own so that a name lookup that hangs cannot hold the caller longer."""
    from huggingface_hub import constants
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    timeout_s = HUB_TIMEOUT_S if timeout_s is None else timeout_s
    answer: list[str | None] = []

    def ask():
        from huggingface_hub.utils import get_session
        try:
            get_session().head(constants.ENDPOINT, timeout=timeout_s)
            answer.append(None)  # any HTTP answer: the hub is there (a refusal is the loader's to say)
        except Exception as e:
            answer.append(f"{constants.ENDPOINT}: {type(e).__name__}: {' '.join(str(e).split())[:200]}")

    asker = threading.Thread(target=ask, daemon=True, name="hub-probe")
    asker.start()
    asker.join(timeout_s + 0.5)
    return answer[0] if answer else f"{constants.ENDPOINT}: no answer within {timeout_s:g} s"
