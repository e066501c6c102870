"""An expert's kind, from its config section: the one place that tells a refiner from the generator."""
from __future__ import annotations

import torch

from experts.build import ExpertKind
from experts.generator import GeneratorConfig, GeneratorKind
from experts.refiner import RefinerKind


def expert_kind(config, expert_id: str) -> ExpertKind:
    spec = config.expert(expert_id)
    return (GeneratorKind if isinstance(spec, GeneratorConfig) else RefinerKind)(config, expert_id, spec)


def build_model(config, expert_id: str, fresh: bool = False, device: torch.device = torch.device("cpu"),
                *, serving: bool = False) -> torch.nn.Module:
    """Expert `expert_id`'s model at version 0: seeded, then from its `init` file unless `fresh`; a
    pretrained model is loaded straight onto `device` (a tiny one is built on the host). `serving`:
    a rollout worker's copy, which a refiner with `engine: vllm` is its vLLM engine."""
    kind = expert_kind(config, expert_id)
    if serving and getattr(kind.spec, "engine", "hf") == "vllm":
        return kind.build_engine(fresh)
    return kind.build_model(fresh, device)
