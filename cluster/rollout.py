"""`RolloutWorker`: inference copies of every expert plus the frozen text encoder.

`rollout` runs refine -> compose -> encode -> generate (SDE, log-probs recorded) -> reward for its
share of a step's samples. It returns three objects: small metadata for the driver, the refiners'
token batches and the generator's trajectories; the last two go to the experts as ObjectRefs.
Weights change only between calls, so every sample is made by one version vector.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from cluster.collective import BroadcastMember, layout
from cluster.recovery import NotSynced, this_node
from cluster.weight_sync import CorruptWeights, as_tensor, fingerprint
from experts.build import build_model
from experts.flow_sde import sample
from experts.seeding import generator
from experts.text_encoder import CachedEncoder
from tasks.reward import Refinement, total_reward
from tasks.reward_guard import GuardedReward, resolve
from tasks.shapes import BOS, EOS, PAD, SEP, decode_ids, strict_correct, to_uint8


def as_text(refinements: list[dict[str, Refinement]]) -> list[dict[str, str]]:
    return [{e: " ".join(r.words) for e, r in refs.items()} for refs in refinements]


class RolloutWorker(BroadcastMember):
    def __init__(self, config, index: int):
        torch.set_num_threads(1)
        self.config, self.index = config, index
        self.refiner_ids = config.experts.ids()[:-1]
        self.models = {eid: build_model(config, eid).eval() for eid in config.experts.ids()}
        self.versions = {eid: None for eid in self.models}
        self.encoder = CachedEncoder(build_model(config, "text_encoder"), version=0)
        self.owners = config.owners()
        self.guarded_reward = GuardedReward(resolve(config.reward.fn), list(config.reward.weights),
                                            config.reward.timeout_s)
        self.faults: dict[str, int] = {}

    def load_weights(self, expert_id: str, version: int, weights: dict, checksum: int | None = None) -> int:
        """Serve `version` of `expert_id` from now on; `weights` must match `checksum` if given.
        With `cluster.share_weights` the model reads them where they lie (read-only views of the
        object store, shared by every worker on the node); else it copies them."""
        share = self.config.cluster.share_weights
        return self.serve(expert_id, version, {k: as_tensor(v) if share else torch.tensor(v) for k, v in weights.items()},
                          checksum)

    def receive_weights(self, expert_id: str, version: int, checksum: int) -> int:
        """Serve `version` of `expert_id`, received from the expert's broadcast (`cluster.sync=collective`)."""
        tensors = self.broadcast_group.receive(expert_id, layout(self.models[expert_id].state_dict()))
        return self.serve(expert_id, version, tensors, checksum)

    def serve(self, expert_id: str, version: int, tensors: dict[str, torch.Tensor], checksum: int | None) -> int:
        """The model reads `tensors` in place from now on, once they match `checksum`; returns `version`."""
        if checksum is not None and fingerprint(tensors) != checksum:
            raise CorruptWeights(f"rollout/{self.index}: {expert_id} v{version} does not match its fingerprint")
        self.models[expert_id].load_state_dict(tensors, assign=True)
        self.versions[expert_id] = version
        return version

    def node(self) -> str | None:
        """The Ray node this worker runs on now (it may move when Ray restarts it)."""
        return this_node()

    def version_vector(self) -> dict:
        return {**self.versions, "text_encoder": self.encoder.version}

    def rollout(self, step: int, items: list[dict]):
        """`items`: {"sample", "prompt", "refine"} per sample, in the driver's global order."""
        missing = [e for e, v in self.versions.items() if v is None]
        if missing:
            raise NotSynced(f"rollout/{self.index} has no weights for {missing}; sync first")
        start = time.perf_counter()
        refinements, kept_ids, refiner_batch = self.refine(step, items)
        noise = self.noise(step, items)
        text, text_pad = self.encoder(self.compose(items, kept_ids))
        states, logps = sample(self.models["generator"], text, text_pad, noise,
                               self.config.experts.generator.noise_level, sde=True)
        self.faults = {}
        terms, valid = self.reward(states[:, -1], items, refinements)
        counterfactual = self.counterfactual(step, items, refinements, kept_ids, noise)
        hits, misses = self.encoder.take_stats()
        versions = self.version_vector()
        meta = {"sample": [it["sample"] for it in items], "terms": terms, "versions": [versions] * len(items),
                "counterfactual": counterfactual, "valid": {"valid": valid}, "faults": self.faults,
                "refinements": as_text(refinements),
                "cache_hits": hits, "cache_misses": misses, "busy_s": time.perf_counter() - start}
        trajectories = {"states": states.numpy(), "logps": logps.numpy(), "text": text.numpy(),
                        "text_pad": text_pad.numpy()}
        return meta, refiner_batch, trajectories

    def draw(self, prompts: list, refine: bool, tag: str = "eval") -> dict:
        """One ODE sample per prompt (refined by every refiner if `refine`), its draws seeded by
        `tag` and the prompt's position: {"images", "refinements"}."""
        items = [{"sample": i, "prompt": p, "refine": refine} for i, p in enumerate(prompts)]
        refinements, kept_ids, _ = self.refine(tag, items)
        text, text_pad = self.encoder(self.compose(items, kept_ids))
        states, _ = sample(self.models["generator"], text, text_pad, self.noise(tag, items),
                           self.config.experts.generator.noise_level, sde=False)
        return {"images": states[:, -1].clamp(-1, 1).numpy(), "refinements": as_text(refinements)}

    def evaluate(self, prompts: list, refine: bool) -> dict:
        """Strict correctness of one ODE sample per prompt, with the images and refinements."""
        out = self.draw(prompts, refine)
        return {**out, "correct": [strict_correct(to_uint8(im), p) for im, p in zip(out["images"], prompts)]}

    def refine(self, step, items: list[dict]):
        """Every refiner's tokens for the samples marked `refine`, each from its own seeded draws."""
        seed = self.config.trainer.seed
        refined = [i for i, it in enumerate(items) if it["refine"]]
        prompts = [list(items[i]["prompt"].ids) for i in refined]
        refinements: list[dict[str, Refinement]] = [{} for _ in items]
        kept_ids: list[dict[str, list[int]]] = [{} for _ in items]
        refiner_batch = {}
        for eid in self.refiner_ids:
            model = self.models[eid]
            if not refined:
                refiner_batch[eid] = {"prompts": []}
                continue
            uniforms = torch.stack([torch.rand(model.max_new_tokens, generator=generator(
                seed, "tokens", step, items[i]["sample"], eid)) for i in refined])
            tokens, logps, mask = model.sample(prompts, uniforms)
            for row, i in enumerate(refined):
                toks = tokens[row].tolist()
                kept_ids[i][eid] = [t for t in toks if t not in (PAD, EOS)]
                refinements[i][eid] = Refinement(tuple(decode_ids(kept_ids[i][eid])), EOS in toks)
            refiner_batch[eid] = {"prompts": prompts, "tokens": tokens.numpy(), "logps": logps.numpy(),
                                  "mask": mask.numpy()}
        return refinements, kept_ids, refiner_batch

    def noise(self, step, items: list[dict]) -> torch.Tensor:
        """Every Gaussian draw of each sample's trajectory (B, T+1, C, H, W), seeded per sample."""
        steps, size = self.config.experts.generator.sample_steps, self.config.task.image_size
        return torch.stack([torch.randn((steps + 1, 3, size, size), generator=generator(
            self.config.trainer.seed, "noise", step, it["sample"])) for it in items])

    def compose(self, items: list[dict], kept_ids: list[dict], drop: str | None = None) -> list[tuple]:
        """The encoder's input: <bos> prompt, then <sep> y_k for each refiner (except `drop`)."""
        return [(BOS, *it["prompt"].ids, *[t for e, ids in kept.items() if e != drop for t in (SEP, *ids)])
                for it, kept in zip(items, kept_ids)]

    def reward(self, images: torch.Tensor, items: list[dict], refinements: list[dict]):
        """(named terms, valid per sample); faults are counted into `self.faults`."""
        terms, valid, faults = self.guarded_reward(images.clamp(-1, 1).numpy(), [it["prompt"] for it in items],
                                                   refinements, self.owners)
        for kind, n in faults.items():
            self.faults[kind] = self.faults.get(kind, 0) + n
        return terms, valid

    def counterfactual(self, step, items, refinements, kept_ids, noise) -> dict[str, np.ndarray]:
        """Per refiner k, R(without y_k): the total reward of the same sample regenerated from the
        same noise with y_k dropped (NaN where not drawn; `counterfactual_fraction` bounds the cost)."""
        algo = self.config.algorithm
        if algo.credit != "counterfactual":
            return {}
        out = {}
        for eid in self.refiner_ids:
            rows = [i for i, it in enumerate(items) if it["refine"] and torch.rand(1, generator=generator(
                self.config.trainer.seed, "counterfactual", step, it["sample"], eid)).item()
                < algo.counterfactual_fraction]
            values = np.full(len(items), np.nan)
            if rows:
                sub = [items[i] for i in rows]
                text, pad = self.encoder(self.compose(sub, [kept_ids[i] for i in rows], drop=eid))
                states, _ = sample(self.models["generator"], text, pad, noise[rows],
                                   self.config.experts.generator.noise_level, sde=True)
                without = [{e: r for e, r in refinements[i].items() if e != eid} for i in rows]
                terms, valid = self.reward(states[:, -1], sub, without)
                values[rows] = np.where(valid, total_reward(terms, self.config.reward.weights), np.nan)
            out[eid] = values
        return out
