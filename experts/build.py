"""Builds each expert's model from the config; the one place that maps a model `kind` to a class."""
from __future__ import annotations

import torch

from experts import state_file
from experts.dit import TinyDiT
from experts.refiner_lm import TinyCausalLM
from experts.seeding import derive_seed
from experts.text_encoder import TextEncoder
from experts.weights import load, model_tensors
from tasks.shapes import MAX_PROMPT_WORDS, VOCAB


def build_model(config, expert_id: str) -> torch.nn.Module:
    """The model of `expert_id` at version 0: its `init` checkpoint if the config names one, else a
    seeded fresh initialisation, identical wherever it is built."""
    model = fresh_model(config, expert_id)
    init = config.experts.text_encoder.init if expert_id == "text_encoder" else config.expert(expert_id).init
    if init:
        load_init_weights(model, init, expert_id)
    return model


def fresh_model(config, expert_id: str) -> torch.nn.Module:
    torch.manual_seed(derive_seed(config.trainer.seed, "init", expert_id))
    if expert_id == "text_encoder":
        te = config.experts.text_encoder
        return TextEncoder(len(VOCAB), te.d_model, te.n_layers, te.n_heads, config.text_len())
    spec = config.expert(expert_id)
    if expert_id == "generator":
        m = spec.model
        if m.kind == "diffusers_flow":
            from experts.sd3 import SD3Velocity
            return SD3Velocity(spec, derive_seed(config.trainer.seed, "init", expert_id))
        return TinyDiT(config.task.image_size, 3, m.patch, m.d_model, m.n_layers, m.n_heads,
                       config.experts.text_encoder.d_model)
    m = spec.model
    if m.kind == "hf_causal_lm":
        from experts.hf_refiner import HFRefiner
        return HFRefiner(spec, derive_seed(config.trainer.seed, "init", expert_id))
    return TinyCausalLM(len(VOCAB), m.d_model, m.n_layers, m.n_heads,
                        MAX_PROMPT_WORDS + 2 + spec.max_new_tokens, spec.max_new_tokens, spec.temperature)


def load_init_weights(model: torch.nn.Module, path: str, expert_id: str) -> None:
    """Start from the weights in an expert file (`checkpoints/step_N/<expert>.safetensors` or a
    pretrained base's), never through pickle."""
    try:
        load(model, model_tensors(model, state_file.read_weights(path)))
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"experts.{expert_id}.init: cannot load weights from '{path}': {e}") from None
