"""`RolloutWorker`: inference copies of every expert plus the frozen text encoder.

`rollout` runs refine -> compose -> encode -> generate (SDE, log-probs recorded) -> reward for its
share of a step's samples. It returns three objects: small metadata for the driver, the refiners'
token batches and the generator's trajectories; the last two go to the experts as ObjectRefs.
Weights change only between calls, so every sample is made by one version vector.
"""
from __future__ import annotations

import numpy as np
import torch

from experts.build import build_model
from experts.flow_sde import sample
from experts.seeding import generator
from experts.text_encoder import CachedEncoder
from tasks.reward import Refinement, shapes_reward
from tasks.shapes import BOS, EOS, PAD, SEP, decode_ids


class RolloutWorker:
    def __init__(self, config, index: int):
        torch.set_num_threads(1)
        self.config, self.index = config, index
        self.refiner_ids = config.experts.ids()[:-1]
        self.models = {eid: build_model(config, eid).eval() for eid in config.experts.ids()}
        self.versions = {eid: None for eid in self.models}
        self.encoder = CachedEncoder(build_model(config, "text_encoder"), version=0)
        self.owners = config.owners()

    def load_weights(self, expert_id: str, version: int, weights: dict) -> int:
        self.models[expert_id].load_state_dict({k: torch.tensor(v) for k, v in weights.items()})
        self.versions[expert_id] = version
        return version

    def version_vector(self) -> dict:
        return {**self.versions, "text_encoder": self.encoder.version}

    def rollout(self, step: int, items: list[dict]):
        """`items`: {"sample", "prompt", "refine"} per sample, in the driver's global order."""
        missing = [e for e, v in self.versions.items() if v is None]
        if missing:
            raise RuntimeError(f"rollout/{self.index} has no weights for {missing}; sync first")
        seed = self.config.trainer.seed
        refined = [i for i, it in enumerate(items) if it["refine"]]
        refinements: list[dict[str, Refinement]] = [{} for _ in items]
        suffixes: list[list[int]] = [[] for _ in items]
        refiner_batch = {}
        for eid in self.refiner_ids:
            model = self.models[eid]
            prompts = [list(items[i]["prompt"].ids) for i in refined]
            uniforms = torch.stack([torch.rand(model.max_new_tokens, generator=generator(
                seed, "tokens", step, items[i]["sample"], eid)) for i in refined]) if refined else None
            tokens, logps, mask = model.sample(prompts, uniforms) if refined else (torch.zeros(0, 0),) * 3
            for row, i in enumerate(refined):
                ids = [t for t in tokens[row].tolist() if t not in (PAD, EOS)]
                refinements[i][eid] = Refinement(tuple(decode_ids(ids)), EOS in tokens[row].tolist())
                suffixes[i] += [SEP, *ids]
            refiner_batch[eid] = {"prompts": prompts, "tokens": tokens.numpy(), "logps": logps.numpy(),
                                  "mask": mask.numpy()}
        texts = [(BOS, *it["prompt"].ids, *suffixes[i]) for i, it in enumerate(items)]
        text, text_pad = self.encoder(texts)
        gen = self.config.experts.generator
        size = self.config.task.image_size
        noise = torch.stack([torch.randn((gen.sample_steps + 1, 3, size, size), generator=generator(
            seed, "noise", step, it["sample"])) for it in items])
        states, logps = sample(self.models["generator"], text, text_pad, noise, gen.noise_level, sde=True)
        images = states[:, -1].clamp(-1, 1).numpy()
        terms = shapes_reward(images, [it["prompt"] for it in items], refinements, self.owners)
        hits, misses = self.encoder.take_stats()
        versions = self.version_vector()
        meta = {"sample": [it["sample"] for it in items], "terms": terms, "versions": [versions] * len(items),
                "refinements": [{e: " ".join(r.words) for e, r in refs.items()} for refs in refinements],
                "cache_hits": hits, "cache_misses": misses}
        trajectories = {"states": states.numpy(), "logps": logps.numpy(), "text": text.numpy(),
                        "text_pad": text_pad.numpy()}
        return meta, refiner_batch, trajectories
