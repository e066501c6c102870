"""How a model named in the config is loaded: in its dtype, its weights read straight onto the
device that uses them, from the folder common/hub.py `local_model` gives (a hub id is fetched there
at its revision first, so no loader here reaches the hub).

Straight onto the device: transformers' and diffusers' `device_map` loading builds the model on the
meta device and reads each tensor of the checkpoint to its place, so a model bound for a GPU is
never whole in host memory first (and never twice on the device).

A model that cannot be had or loaded is the user's to fix (a name, a download, a folder transformers
cannot read), wherever it is loaded: `loading_model` raises it as a ModelLoadError naming the config
key and the model, in one line, so that an actor that cannot start says which key to change."""
from __future__ import annotations

import importlib
from contextlib import contextmanager

import torch

from common.config import SettingError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WEIGHTED = ("text_encoder", "transformer", "vae")  # a pipeline's components with weights


class ModelLoadError(SettingError, RuntimeError):
    """A model a config key names could not be fetched or loaded."""

    def __init__(self, key: str, model: str, reason: str):
        super().__init__(key, model, reason)  # its args: it pickles as it is (out of an actor)
        self.config_key, self.model, self.reason = key, model, reason

    def __str__(self) -> str:
        return f"{self.config_key}: cannot load '{self.model}' ({self.reason})"


def one_line(error: BaseException, limit: int = 400) -> str:
    """`error` as one line: its type and its message's words, cut at `limit` characters."""
    text = f"{type(error).__name__}: {' '.join(str(error).split())}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def out_of_memory(error: BaseException) -> bool:
    """Running out of host or device memory: not the model's fault, whatever was being loaded."""
    return isinstance(error, MemoryError) or "out of memory" in str(error).lower()


def from_the_hub(error: BaseException) -> bool:
    """Whether `error` (or what it was raised from) is the hub client's or its HTTP library's."""
    while error is not None:
        if type(error).__module__.split(".")[0] in ("huggingface_hub", "httpx", "httpx2", "requests", "urllib3"):
            return True
        error = error.__cause__ or error.__context__
    return False


def load_error(error: BaseException, key: str, model: str) -> ModelLoadError:
    """`error`, raised while fetching or loading `model` (named by `key`), as the user reads it."""
    hint = "; fetch it beforehand where the hub gives it (a gated model with HF_TOKEN set): `jointrl download " \
           "--config <your config>`" if from_the_hub(error) else ""
    return ModelLoadError(key, model, one_line(error) + hint)


@contextmanager
def loading_model(key: str, model: str):
    """The block loads `model`, which the config key `key` names: an error (but running out of
    memory) is raised as a ModelLoadError naming both."""
    try:
        yield
    except ModelLoadError:
        raise
    except Exception as error:
        if out_of_memory(error):
            raise
        raise load_error(error, key, model) from error


def pretrained(cls, path: str, dtype: torch.dtype | None, device: torch.device, **kwargs):
    """`cls.from_pretrained(path, **kwargs)` for a transformers or diffusers model class: in `dtype`
    (None: the checkpoint's), its weights read onto `device`."""
    dtype_key = "dtype" if cls.__module__.startswith("transformers") else "torch_dtype"
    return cls.from_pretrained(path, **({dtype_key: dtype} if dtype is not None else {}),
                               device_map=torch.device(device), **kwargs)


def load_index(path: str) -> dict:
    """The pipeline's `model_index.json`."""
    from diffusers import DiffusionPipeline
    return DiffusionPipeline.load_config(path)


def component(path: str, index: dict, name: str, dtype: torch.dtype | None = None,
              *, device: torch.device = torch.device("cpu")):
    """The pipeline component `name` (None where the model has none, e.g. SD3 without T5); one with
    weights in `dtype`, on `device`."""
    library, cls = index.get(name) or (None, None)
    if cls is None:
        return None
    found = getattr(importlib.import_module(library), cls)
    if name.startswith(WEIGHTED):
        return pretrained(found, path, dtype, device, subfolder=name)
    return found.from_pretrained(path, subfolder=name)


def load_tokenizer(path: str):
    """The tokenizer saved with the model: its tokenizer.json as it is (AutoTokenizer may rebuild
    it as the class of the model's type), else whatever AutoTokenizer makes of the folder."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    try:
        return PreTrainedTokenizerFast.from_pretrained(path)
    except (OSError, ValueError):
        return AutoTokenizer.from_pretrained(path)
