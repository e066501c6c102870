"""What every diffusers flow family shares: the trained transformer with its LoRA adapter and guidance
(`FamilyVelocity`), and the frozen front end with its text cache (`FamilyFrontEnd`), both loaded by
common/loading.py. A family module (experts/sd3.py, flux1.py, flux2.py, qwen_image.py) subclasses both
and fills in what only it knows: how its transformer reads a latent and a condition, how its prompts
are encoded, its sigmas and its way back to pixels (experts/families.py).

Conditioning convention: `cond` is a dict of per-sample tensors, in the text encoders' dtype; its
`negative_<name>` entries are the empty prompt's, one row that the velocity broadcasts to the batch,
present only when classifier-free guidance is on. Dropping them (the update's `train_cfg=false`)
gives the conditional velocity alone.
"""
from __future__ import annotations

import contextlib

import numpy as np
import torch
from torch import nn

from common.hub import local_model
from common.loading import DTYPES, component, load_index
from experts.text_encoder import CacheStats, FeatureCache

NEGATIVE = "negative_"


def split_negative(cond: dict) -> tuple[dict, dict]:
    """(the prompt's conditioning, the empty prompt's, without its prefix)."""
    positive = {k: v for k, v in cond.items() if not k.startswith(NEGATIVE)}
    negative = {k[len(NEGATIVE):]: v for k, v in cond.items() if k.startswith(NEGATIVE)}
    return positive, negative


class FamilyVelocity(nn.Module):
    """The trained transformer as v(x, sigma | cond) on the latent grid (B, *latent_shape), with
    classifier-free guidance when `cond` carries the empty prompt's conditioning. Subclasses define
    `velocity(x, sigma, cond)` (one branch) and `conditioning` (what `cond` holds, for the memory
    plan), and may override `guide` and `LORA_TARGETS`."""
    LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]  # the joint attention's projections

    @staticmethod
    def conditioning(transformer: dict, model) -> tuple[dict, int]:
        """The conditioning `velocity` reads, as ({name: (shape of one sample, dtype or None for the
        model's)}, the text tokens it attends to), from the transformer's config and the model
        section (experts/memory.py traces the velocity on inputs of these shapes)."""
        raise NotImplementedError

    def __init__(self, spec, seed: int, device: torch.device = torch.device("cpu")):
        super().__init__()
        m = spec.model
        self.spec = m
        self.path = local_model(m.path, m.revision)
        self.index = load_index(self.path)
        self.load_trained(seed, device)

    def load_trained(self, seed: int, device: torch.device) -> None:
        """The trained transformer(s) of the pipeline: `transformer`."""
        self.transformer = self.trained_component("transformer", seed, device)

    def trained_component(self, name: str, seed: int, device: torch.device) -> nn.Module:
        """The pipeline's transformer `name` in the model's dtype, with the LoRA adapter where one is set."""
        m = self.spec
        transformer = component(self.path, self.index, name, DTYPES[m.dtype], device=device)
        if m.lora:
            from peft import LoraConfig
            torch.manual_seed(seed)  # the adapter's initialisation, identical wherever it is built
            transformer.add_adapter(LoraConfig(r=m.lora.r, lora_alpha=m.lora.alpha, lora_dropout=m.lora.dropout,
                                               target_modules=m.lora.target_modules or self.LORA_TARGETS,
                                               init_lora_weights=True))
            for param in transformer.parameters():  # add_adapter casts the adapter to the model's dtype:
                if param.requires_grad:             # it trains in fp32 (as Flow-GRPO's), on a bf16 base too
                    param.data = param.data.float()
        return transformer

    @property
    def lora(self) -> bool:
        return self.spec.lora is not None

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: dict) -> torch.Tensor:
        raise NotImplementedError

    def guide(self, uncond: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """Classifier-free guidance: v_uncond + g (v_cond - v_uncond)."""
        return uncond + self.spec.guidance_scale * (cond - uncond)

    def forward(self, x, sigma, **cond) -> torch.Tensor:
        """v(x, sigma | text), guided against the empty prompt when `cond` holds its conditioning
        (one row, shared by the batch); both branches in one batch."""
        positive, negative = split_negative(cond)
        if not negative or self.spec.guidance_scale == 1.0:
            return self.velocity(x, sigma, positive)
        shared = {k: v.expand(len(x), *v.shape[1:]) for k, v in negative.items()}
        both = self.velocity(torch.cat([x, x]), torch.cat([sigma, sigma]), self.merge_conditions([shared, positive]))
        uncond, conditional = both.chunk(2)
        return self.guide(uncond, conditional)

    @staticmethod
    def merge_conditions(conds: list[dict]) -> dict[str, torch.Tensor]:
        """Several batches' conditioning as one batch (fixed-length embeddings: joined)."""
        return {k: torch.cat([torch.as_tensor(c[k]) for c in conds]) for k in conds[0]}

    def synced_state(self) -> dict[str, torch.Tensor]:
        state = self.state_dict()
        return {k: v for k, v in state.items() if "lora_" in k} if self.lora else state

    @contextlib.contextmanager
    def adapter_disabled(self):
        """A context in which the transformer is its frozen base (LoRA): the reference, without a copy."""
        self.transformer.disable_adapters()
        try:
            yield
        finally:
            self.transformer.enable_adapters()


class FamilyFrontEnd:
    """What a rollout worker keeps frozen: the family's text encoders behind a cache keyed by the
    composed text (`rollout.text_cache_mb` of features in the encoders' dtype, the least recently
    used evicted first), its VAE and its scheduler. Subclasses name their `COMPONENTS` and define
    `encode_texts` (or `features` and `join`), `latent_grid`, `sigmas` and `decode`."""
    COMPONENTS: tuple[str, ...] = ()
    ENCODERS = ("vae", "text_encoder", "text_encoder_2", "text_encoder_3")  # its frozen modules
    FLOAT32: tuple[str, ...] = ()  # components kept in float32 whatever the model's dtype (as the family's examples)

    def __init__(self, config, device: torch.device):
        m = config.experts.generator.model
        self.config, self.spec, self.device = config, m, device
        self.path = local_model(m.path, m.revision)
        self.index = load_index(self.path)
        self.parts = {name: component(self.path, self.index, name,
                                      torch.float32 if name in self.FLOAT32 else DTYPES[m.dtype], device=device)
                      for name in self.COMPONENTS}
        for name in self.ENCODERS:
            if self.parts.get(name) is not None:
                self.parts[name].requires_grad_(False).eval()
        self.vae, self.scheduler = self.parts.get("vae"), self.parts.get("scheduler")
        self.latent_shape = self.latent_grid(config.task.image_size)
        self.cache = FeatureCache(int(config.rollout.text_cache_mb * 2 ** 20))
        self.stats = CacheStats()
        self.version = 0  # the text encoders never train

    def check_side(self, factor: int) -> int:
        """task.image_size / `factor` (the pixels per latent cell of the family); ValueError if it is not whole."""
        size = self.config.task.image_size
        if size % factor:
            raise ValueError(f"task.image_size={size} is not a multiple of {factor}, the pixels per latent cell "
                             f"of experts.generator.model.path={self.spec.path}")
        return size // factor

    def latent_grid(self, image_size: int) -> tuple[int, ...]:
        """The shape of one latent on the flow's grid (unpacked), for images `image_size` on a side."""
        raise NotImplementedError

    def encode_texts(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """The family's conditioning of `texts`, each entry (len(texts), ...), fixed-length per sample."""
        raise NotImplementedError

    def features(self, texts: list[str]) -> list[dict[str, torch.Tensor]]:
        """Each text's conditioning on its own (no batch axis), in the text encoders' dtype, every
        tensor owning its storage (what the cache keeps)."""
        batch = self.encode_texts(texts)
        return [{k: v[i].clone() for k, v in batch.items()} for i in range(len(texts))]

    def join(self, features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Texts' `features` as one batch of conditioning (fixed-length: stacked)."""
        return {k: torch.stack([f[k] for f in features]) for k in features[0]}

    def sigmas(self, steps: int) -> torch.Tensor:
        """The family's sigmas for `steps` steps, from 1 down to 0 (T+1,), shifted as its pipeline does."""
        raise NotImplementedError

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W) in [-1, 1] from latents on the flow's grid."""
        raise NotImplementedError

    def compose(self, prompt, refs: dict, drop: str | None) -> str:
        """The prompt, then each refiner's refinement (except `drop`), as one text; under
        task.compose=replace the refinements alone, where any was written (PromptRL's generator
        reads the rewrite instead of the prompt)."""
        order = self.config.experts.active_refiners()
        written = [refs[e].text for e in order if e in refs and e != drop and refs[e].text]
        return ", ".join(written if written and self.config.task.compose == "replace" else [prompt.text, *written])

    @torch.no_grad()
    def encode(self, texts: list[str]) -> dict[str, torch.Tensor]:
        """The batch of `texts`' features, each distinct text's computed once while the cache holds it."""
        self.stats.count(texts, self.cache)
        found = {t: self.cache.get(t) for t in dict.fromkeys(texts)}
        missing = [t for t, f in found.items() if f is None]
        if missing:
            for t, f in zip(missing, self.features(missing)):
                found[t] = f
                self.cache.put(t, f)
        return self.join([found[t] for t in texts])

    def condition(self, prompts: list, refinements: list[dict], drop: str | None = None) -> dict[str, torch.Tensor]:
        """The conditioning of each sample's composed text, and under guidance the empty prompt's
        (one row: the velocity broadcasts it)."""
        cond = self.encode([self.compose(p, r, drop) for p, r in zip(prompts, refinements)])
        if self.spec.guidance_scale != 1.0:
            cond.update({NEGATIVE + k: v for k, v in self.encode([""]).items()})
        return cond

    def scheduler_sigmas(self, steps: int, **kwargs) -> torch.Tensor:
        """The scheduler's own sigmas (with its trailing 0) after `set_timesteps(steps, **kwargs)`."""
        self.scheduler.set_timesteps(steps, **kwargs)
        return self.scheduler.sigmas.float().clone()

    def token_shifted_sigmas(self, steps: int, image_tokens: int) -> torch.Tensor:
        """FLUX.1's and Qwen-Image's schedule: linspace(1, 1/N, N) shifted by mu = calculate_shift of
        the image's token count, from the scheduler's config (diffusers' one function for both)."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift
        c = self.scheduler.config
        mu = calculate_shift(image_tokens, c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
                             c.get("base_shift", 0.5), c.get("max_shift", 1.15))
        return self.scheduler_sigmas(steps, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)

    def take_stats(self) -> tuple[int, int]:
        return self.stats.take()
