"""How a model named in the config is loaded: a diffusers pipeline's components, a tokenizer, the dtypes."""
from __future__ import annotations

import importlib

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_index(path: str) -> dict:
    """The pipeline's `model_index.json`."""
    from diffusers import DiffusionPipeline
    return DiffusionPipeline.load_config(path)


def component(path: str, index: dict, name: str, dtype: torch.dtype | None = None):
    """The pipeline component `name` (None where the model has none, e.g. SD3 without T5)."""
    library, cls = index.get(name) or (None, None)
    if cls is None:
        return None
    kwargs = {"subfolder": name}
    if dtype is not None and name.startswith(("text_encoder", "transformer", "vae")):
        kwargs["dtype" if library == "transformers" else "torch_dtype"] = dtype
    return getattr(importlib.import_module(library), cls).from_pretrained(path, **kwargs)


def load_tokenizer(path: str):
    """The tokenizer saved with the model: its tokenizer.json as it is (AutoTokenizer may rebuild
    it as the class of the model's type), else whatever AutoTokenizer makes of the folder."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    try:
        return PreTrainedTokenizerFast.from_pretrained(path)
    except (OSError, ValueError):
        return AutoTokenizer.from_pretrained(path)
