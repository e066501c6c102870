"""A model at version 0, identical wherever it is built: seeded by its name, then loaded from its
`init` file if the config names one (safetensors only, never through pickle)."""
from __future__ import annotations

from typing import Callable

import torch

from common.loading import loading_model
from common.seeding import derive_seed
from experts import state_file
from experts.weights import load, model_tensors


def seeded_model(config, name: str, make: Callable[[], torch.nn.Module], init: str | None = None) -> torch.nn.Module:
    """`make()` under the seed of (trainer.seed, "init", `name`), then the weights of `init` if given."""
    torch.manual_seed(derive_seed(config.trainer.seed, "init", name))
    model = make()
    if init:
        load_init_weights(model, init, name)
    return model


def load_init_weights(model: torch.nn.Module, path: str, name: str) -> None:
    """Start from the weights in an expert file (`checkpoints/step_N/<expert>.safetensors` or a
    pretrained base's), never through pickle."""
    try:
        load(model, model_tensors(model, state_file.read_weights(path)))
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"experts.{name}.init: cannot load weights from '{path}': {e}") from None


class ExpertKind:
    """What one kind of expert (a refiner, the generator) brings: its config section, its model,
    which rollout outputs and advantages it learns from, how shards merge, and its loss with its
    gradient (`backward`)."""

    def __init__(self, config, expert_id: str, spec):
        self.config, self.expert_id, self.spec = config, expert_id, spec

    def fresh_model(self, device: torch.device) -> torch.nn.Module:
        """The model before `init`: a pretrained one loaded onto `device`, a tiny one built on the host
        (its caller moves it)."""
        raise NotImplementedError

    def build_model(self, fresh: bool = False, device: torch.device = torch.device("cpu")) -> torch.nn.Module:
        """The model at version 0: seeded, then from `init` unless `fresh`; a pretrained one on `device`
        (one that cannot be loaded raises a ModelLoadError naming `experts.<id>.model.path`)."""
        return seeded_model(self.config, self.expert_id, lambda: self.loaded_model(device),
                            None if fresh else self.spec.init)

    def loaded_model(self, device: torch.device) -> torch.nn.Module:
        """`fresh_model`, any failure to load a pretrained model said as its `path` key's."""
        path = getattr(self.spec.model, "path", None)
        if path is None:
            return self.fresh_model(device)
        with loading_model(f"experts.{self.expert_id}.model.path", path):
            return self.fresh_model(device)

    def backward(self, model, reference, batch: dict, adv: torch.Tensor, *, rows: torch.Tensor | None = None,
                 before_last: Callable[[], None] | None = None, pad_to: int | None = None) -> tuple[float, dict]:
        """Accumulate the loss's gradient into the trainable parameters; (its value, its stats).
        `rows`: only these samples' part of it, divided by the whole batch's count (one rank's
        share: experts/parallel.py). A kind goes in parts (micro-batches) so that an update fits
        in memory, calling `before_last` before the last part's backward pass; `pad_to`: a share
        smaller than the largest rank's makes as many passes as it (zero-weight ones: fsdp)."""
        raise NotImplementedError
