"""How a model named in the config is loaded: in its dtype, its weights read straight onto the
device that uses them, from the folder common/hub.py `local_model` gives (a hub id is fetched there
at its revision first, so no loader here reaches the hub).

Straight onto the device: transformers' and diffusers' `device_map` loading builds the model on the
meta device and reads each tensor of the checkpoint to its place, so a model bound for a GPU is
never whole in host memory first (and never twice on the device)."""
from __future__ import annotations

import importlib

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WEIGHTED = ("text_encoder", "transformer", "vae")  # a pipeline's components with weights


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
              device: torch.device = torch.device("cpu")):
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
