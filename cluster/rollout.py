"""`RolloutWorker`: inference copies of every expert plus the generator's frozen front end (text
encoding, latent space, decoding: experts/frontend.py).

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
from cluster.reward_pool import PooledReward
from cluster.weight_sync import CorruptWeights, fingerprint
from experts.build import build_model
from experts.devices import actor_device
from experts.flow_sde import sample, sde_steps
from experts.frontend import build_frontend
from experts.seeding import generator
from experts.weights import load, model_tensors, synced_state, travel_form
from tasks.reward import Refinement, total_reward
from tasks.reward_guard import GuardedReward, resolve
from tasks.shapes import strict_correct, to_uint8


def as_text(refinements: list[dict[str, Refinement]]) -> list[dict[str, str]]:
    return [{e: " ".join(r.words) for e, r in refs.items()} for refs in refinements]


class RolloutWorker(BroadcastMember):
    def __init__(self, config, index: int, reward_actors: list | None = None):
        """`reward_actors`: the pool that scores this worker's batches (`reward.actors`), if any."""
        torch.set_num_threads(1)
        self.config, self.index = config, index
        self.refiner_ids = config.experts.ids()[:-1]
        self.device = actor_device(config.cluster.rollout_resources)
        self.models = {eid: build_model(config, eid).eval().to(self.device) for eid in config.experts.ids()}
        self.versions = {eid: None for eid in self.models}
        self.held: dict[str, dict[int, dict]] = {eid: {} for eid in self.models}  # expert -> version -> tensors
        self.frontend = build_frontend(config, self.device)
        steps = config.experts.generator.sample_steps
        self.sigmas, self.sde = self.frontend.sigmas(steps), sde_steps(steps, config.experts.generator.sde_window)
        self.owners = config.owners()
        score = PooledReward(reward_actors, index, config.cluster.max_restarts) if reward_actors \
            else resolve(config.reward.fn)
        self.guarded_reward = GuardedReward(score, list(config.reward.weights), config.reward.timeout_s)
        self.faults: dict[str, int] = {}

    def load_weights(self, expert_id: str, version: int, weights: dict, checksum: int | None = None) -> int:
        """Serve `version` of `expert_id` from now on; `weights` (travelled arrays) must match
        `checksum` if given. With `cluster.share_weights` the model reads them where they lie
        (read-only views of the object store, shared by every worker on the node); else it copies them."""
        return self.serve(expert_id, version, weights, checksum, self.config.cluster.share_weights)

    def receive_weights(self, expert_id: str, version: int, checksum: int) -> int:
        """Serve `version` of `expert_id`, received from the expert's broadcast (`cluster.sync=collective`)."""
        plan = layout(travel_form(synced_state(self.models[expert_id])))
        return self.serve(expert_id, version, self.broadcast_group.receive(expert_id, plan), checksum, share=True)

    def serve(self, expert_id: str, version: int, weights: dict, checksum: int | None, share: bool) -> int:
        """Hold `weights` as `version` once they match `checksum`, and serve them if no newer version
        is being served; returns `version`. A rollout names the versions it must be made with, so
        one submitted before this delivery arrived is still made with the older version it named."""
        if checksum is not None and fingerprint(weights) != checksum:
            raise CorruptWeights(f"rollout/{self.index}: {expert_id} v{version} does not match its fingerprint")
        self.held[expert_id][version] = model_tensors(self.models[expert_id], weights, share)
        if self.versions[expert_id] is None or version >= self.versions[expert_id]:
            self.use(expert_id, version)
        return version

    def use(self, expert_id: str, version: int) -> None:
        """Serve the held `version` of `expert_id` (its model reads those tensors in place)."""
        if self.versions[expert_id] != version:
            load(self.models[expert_id], self.held[expert_id][version], assign=True)
            self.versions[expert_id] = version

    def use_versions(self, versions: dict[str, int]) -> None:
        """Serve exactly `versions`, and forget held versions older than them: later rollouts,
        submitted in step order, never ask for those again (a redone one has them delivered anew)."""
        missing = {e: v for e, v in versions.items() if v is None or v not in self.held[e]}
        if missing:
            raise NotSynced(f"rollout/{self.index} does not hold {missing}; sync first")
        for expert_id, version in versions.items():
            self.use(expert_id, version)
            self.held[expert_id] = {v: w for v, w in self.held[expert_id].items() if v >= version}

    def node(self) -> str | None:
        """The Ray node this worker runs on now (it may move when Ray restarts it)."""
        return this_node()

    def version_vector(self) -> dict:
        return {**self.versions, "text_encoder": self.frontend.version}

    def rollout(self, step: int, items: list[dict], versions: dict[str, int] | None = None):
        """`items`: {"sample", "prompt", "refine"} per sample, in the driver's global order, made
        with the experts' `versions` (those published when the driver submitted it; None: the
        versions served now)."""
        self.use_versions(versions or dict(self.versions))
        start = time.perf_counter()
        refinements, refiner_batch = self.refine(step, items)
        noise = self.noise(step, items)
        cond = self.frontend.condition([it["prompt"] for it in items], refinements)
        states, logps = self.generate(cond, noise, sde=True)
        self.faults = {}
        images = self.frontend.decode(states[:, -1])
        terms, valid = self.reward(images, items, refinements)
        counterfactual = self.counterfactual(step, items, refinements, noise)
        hits, misses = self.frontend.take_stats()
        versions = self.version_vector()
        meta = {"sample": [it["sample"] for it in items], "terms": terms, "versions": [versions] * len(items),
                "counterfactual": counterfactual, "valid": {"valid": valid}, "faults": self.faults,
                "refinements": as_text(refinements),
                "cache_hits": hits, "cache_misses": misses, "busy_s": time.perf_counter() - start}
        if self.shows_images(step):
            meta["images"] = np.stack([to_uint8(im) for im in images.cpu().numpy()])
        trajectories = {"states": states.cpu().numpy(), "logps": logps.cpu().numpy(),
                        "cond": {k: v.cpu().numpy() for k, v in cond.items()},
                        "sigmas": self.sigmas.numpy(), "sde": self.sde.numpy()}
        return meta, refiner_batch, trajectories

    def shows_images(self, step: int) -> bool:
        """Whether `step`'s images go to the trackers (`logging.images_every`, and the last step)."""
        every = self.config.logging.images_every
        return bool(every) and (step % every == 0 or step == self.config.trainer.steps - 1)

    def draw(self, prompts: list, refine: bool, tag: str = "eval") -> dict:
        """One ODE sample per prompt (refined by every refiner if `refine`), its draws seeded by
        `tag` and the prompt's position: {"images", "refinements"}."""
        items = [{"sample": i, "prompt": p, "refine": refine} for i, p in enumerate(prompts)]
        refinements, _ = self.refine(tag, items)
        cond = self.frontend.condition(prompts, refinements)
        states, _ = self.generate(cond, self.noise(tag, items), sde=False)
        return {"images": self.frontend.decode(states[:, -1]).cpu().numpy(), "refinements": as_text(refinements)}

    def generate(self, cond: dict, noise: torch.Tensor, sde: bool):
        """The generator's trajectories from `noise` under `cond`: SDE on `generator.sde_window`'s
        steps (all of them by default) if `sde`, else an ODE all the way (evaluation, sampling)."""
        generator = self.models["generator"]
        window = self.sde if sde else torch.zeros_like(self.sde)
        return sample(lambda x, sigma: generator(x, sigma, **cond), noise.to(self.device), self.sigmas,
                      self.config.experts.generator.noise_level, window)

    def evaluate(self, prompts: list, refine: bool) -> dict:
        """Strict correctness of one ODE sample per prompt, with the images and refinements."""
        out = self.draw(prompts, refine)
        return {**out, "correct": [strict_correct(to_uint8(im), p) for im, p in zip(out["images"], prompts)]}

    def refine(self, step, items: list[dict]):
        """Every refiner's refinement of the samples marked `refine`, each from its own seeded
        draws: (per sample {refiner: Refinement}, per refiner its token batch for the update)."""
        seed = self.config.trainer.seed
        refined = [i for i, it in enumerate(items) if it["refine"]]
        refinements: list[dict[str, Refinement]] = [{} for _ in items]
        refiner_batch = {}
        for eid in self.refiner_ids:
            model = self.models[eid]
            if not refined:
                refiner_batch[eid] = {"prompts": []}
                continue
            prompts = [model.prompt_ids(items[i]["prompt"]) for i in refined]
            uniforms = torch.stack([torch.rand(model.max_new_tokens, generator=generator(
                seed, "tokens", step, items[i]["sample"], eid)) for i in refined])
            tokens, logps, mask = (t.cpu() for t in model.sample(prompts, uniforms.to(self.device)))
            for row, i in enumerate(refined):
                refinements[i][eid] = model.refinement(tokens[row].tolist(), mask[row].tolist())
            refiner_batch[eid] = {"prompts": prompts, "tokens": tokens.numpy(), "logps": logps.numpy(),
                                  "mask": mask.numpy()}
        return refinements, refiner_batch

    def noise(self, step, items: list[dict]) -> torch.Tensor:
        """Every Gaussian draw of each sample's trajectory (B, T+1, *latent), seeded per sample."""
        steps = self.config.experts.generator.sample_steps
        return torch.stack([torch.randn((steps + 1, *self.frontend.latent_shape), generator=generator(
            self.config.trainer.seed, "noise", step, it["sample"])) for it in items])

    def reward(self, images: torch.Tensor, items: list[dict], refinements: list[dict]):
        """(named terms, valid per sample) of decoded images in [-1, 1]; faults are counted into `self.faults`."""
        terms, valid, faults = self.guarded_reward(images.cpu().numpy(), [it["prompt"] for it in items],
                                                   refinements, self.owners)
        for kind, n in faults.items():
            self.faults[kind] = self.faults.get(kind, 0) + n
        return terms, valid

    def counterfactual(self, step, items, refinements, noise) -> dict[str, np.ndarray]:
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
                cond = self.frontend.condition([it["prompt"] for it in sub], [refinements[i] for i in rows], drop=eid)
                states, _ = self.generate(cond, noise[rows], sde=True)
                without = [{e: r for e, r in refinements[i].items() if e != eid} for i in rows]
                terms, valid = self.reward(self.frontend.decode(states[:, -1]), sub, without)
                values[rows] = np.where(valid, total_reward(terms, self.config.reward.weights), np.nan)
            out[eid] = values
        return out
