"""Config pieces every expert kind shares: parallelism, LoRA, the text encoder (the strict base and
Ray resources are common/config.py's).

Expert config sections live next to their kinds (experts/refiner.py, experts/generator.py), so this
module is pure: it imports neither the driver, the cluster nor Ray, and checks nothing outside the
values themselves (files, models and packages are checked by driver/preflight.py).
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt

from common.config import Strict


class ParallelConfig(Strict):
    """One expert on several processes (experts/parallel.py): M rank actors, one version."""
    ranks: PositiveInt = Field(1, description="processes (each with the expert's `resources`) the expert trains "
                                              "on; each computes the loss of its share of the step's samples")
    strategy: Literal["ddp", "fsdp"] = Field("ddp", description="ddp: every rank holds the whole model, gradients "
                                                                 "summed across ranks; fsdp: parameters, gradients "
                                                                 "and optimizer state sharded across ranks (FSDP2)")
    activation_checkpointing: bool = Field(False, description="recompute each transformer block's activations in "
                                                              "the backward pass: less memory, more time")
    reshard_after_forward: bool = Field(True, description="fsdp: free each block's gathered parameters after its "
                                                          "forward pass and gather them again for the backward; "
                                                          "false keeps them to the backward (fewer all-gathers, "
                                                          "the whole model gathered at the peak)")
    defer_gradient_sync: bool = Field(False, description="fsdp: keep the parameters gathered and the gradients "
                                                          "whole through all of an update's backward passes and "
                                                          "reduce-scatter once, at the last (one all-gather and "
                                                          "one reduce-scatter per block per update, for ddp's "
                                                          "memory while the update runs; sharded again after)")


class LoraConfig(Strict):
    """A LoRA adapter (peft): only it trains, syncs and is checkpointed; the reference is the base."""
    r: PositiveInt = Field(8, description="rank of the adapter's low-rank update")
    alpha: PositiveFloat = Field(16.0, description="LoRA scaling numerator: the update is scaled by alpha / r")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapter's input while training")
    target_modules: list[str] | None = Field(None, description="module names the adapter wraps; None: the "
                                                               "attention projections of the model's kind")


class TextEncoderConfig(Strict):
    """The tiny generator's text encoder (the diffusers kind brings its own encoders)."""
    d_model: PositiveInt = Field(64, description="width of the encoder's transformer")
    n_layers: PositiveInt = Field(2, description="transformer blocks")
    n_heads: PositiveInt = Field(4, description="attention heads per block")
    max_sequence_length: int = Field(38, ge=2, description="most tokens the encoder reads, whatever the number "
                                     "of refiners: the composed text (<bos>, the prompt's up to 16 words, then "
                                     "<sep> and each refiner's words in refiner order) is cut to its first this "
                                     "many, as a real text encoder's tokenizer truncates at its maximum length, "
                                     "so the last refiners' words are the ones dropped; 38 holds a full prompt "
                                     "and three refinements of 6 tokens whole")
    init: str | None = Field(None, description="a safetensors checkpoint to start from (pretrained with the "
                                               "generator by `jointrl pretrain`); None: random initialisation")


def default_kind(kind: str):
    """A `model` section without `kind` (e.g. `--set experts.generator.model.d_model=128`) is the tiny one."""
    def fill(data):
        if isinstance(data, dict) and isinstance(data.get("model"), dict) and "kind" not in data["model"]:
            data = {**data, "model": {"kind": kind, **data["model"]}}
        return data
    return fill
