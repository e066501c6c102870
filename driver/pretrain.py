"""`jointrl pretrain`: the base generator and text encoder, by flow matching on rendered pairs.

RL starts from a model that roughly works, as PromptRL starts from FLUX. Captions mix the full,
terse and paraphrased wordings of every category; images are the renderer's ground truth. The
loss is rectified flow's: x_s = (1 - s) x + s eps, target v = eps - x, s ~ logit-normal. The saved
weights are an EMA of the trained ones, cached under a hash of everything that shapes them, so a
second call with the same config reuses the first's result.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from driver.checkpoint import atomic_dir
from experts import state_file
from experts.frontend import build_text_encoder
from experts.kinds import build_model
from experts.seeding import derive_seed
from tasks.shapes import (BOS, CATEGORIES, EOS, PAD, QUALITY_WORDS, SEP, STYLE_WORDS, VOCAB, WORD_TO_ID, Prompt,
                          make_prompt, paraphrase, render)

FORMAT = 3  # bump when what a base holds changes


def cache_key(config) -> str:
    shaping = {"format": FORMAT, "vocab": VOCAB, "task": config.task.model_dump(),
               "generator": config.experts.generator.model.model_dump(),
               "text_encoder": config.experts.text_encoder.model_dump(exclude={"init"}),
               "text_len": config.text_len(),
               "details": [r.max_new_tokens for r in config.experts.refiners],
               "pretrain": config.pretrain.model_dump(exclude={"out_dir", "threads", "refiner_steps", "refiner_lr"})}
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:12]


def base_dir(config) -> Path:
    return Path(config.pretrain.out_dir) / f"base-{cache_key(config)}"


def refiner_key(config, refiner) -> str:
    shaping = {"format": FORMAT, "vocab": VOCAB, "model": refiner.model.model_dump(),
               "max_new_tokens": refiner.max_new_tokens, "temperature": refiner.temperature,
               "pretrain": config.pretrain.model_dump(include={"refiner_steps", "refiner_lr", "batch_size", "seed",
                                                               "degraded_share"})}
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:12]


def detail_words(rng: np.random.Generator, degraded: bool, max_words: int) -> list[str]:
    """One segment of refinement-shaped text: 1 to `max_words` style words. Only clean images are
    ever described with quality words, as in web data where "sharp, detailed" captions come with
    good pictures; so a base prompted plainly makes the dataset's mix of clean and degraded
    images, and one prompted with quality words makes clean ones."""
    plain = [w for w in STYLE_WORDS if w not in QUALITY_WORDS]
    words = [str(w) for w in rng.choice(plain, size=int(rng.integers(1, max_words + 1)))]
    if not degraded and rng.random() < 0.6:
        words[rng.integers(len(words))] = str(rng.choice(QUALITY_WORDS))
    return words


def details(rng: np.random.Generator, degraded: bool, max_segments: int, max_words: int) -> list[int]:
    """Half the captions get 1 to `max_segments` "<sep> words" segments after the prompt."""
    if rng.random() < 0.5:
        return []
    segments = [detail_words(rng, degraded, max_words) for _ in range(rng.integers(1, max_segments + 1))]
    return [t for words in segments for t in (SEP, *(WORD_TO_ID[w] for w in words))]


def random_prompt(rng: np.random.Generator) -> Prompt:
    """A prompt of a random category and wording (terse or full), paraphrased a third of the time."""
    p = make_prompt(CATEGORIES[rng.integers(len(CATEGORIES))], rng, terse=bool(rng.integers(2)))
    return paraphrase(p) if rng.random() < 1 / 3 else p


def caption_batch(rng: np.random.Generator, n: int, size: int, degraded_share: float = 0.0,
                  max_segments: int = 0, max_words: int = 0):
    """`n` rendered (caption ids, image in [-1, 1]) pairs over every category and wording; a
    `degraded_share` of the images are degraded, and some captions carry style details."""
    ids, images = [], []
    for _ in range(n):
        p = random_prompt(rng)
        degraded = bool(rng.random() < degraded_share)
        images.append(render(p, rng, size, degraded))
        ids.append([BOS, *p.ids, *(details(rng, degraded, max_segments, max_words) if max_segments else [])])
    images = np.stack(images).astype(np.float32) / 127.5 - 1.0
    width = max(map(len, ids))
    ids = torch.tensor([i + [PAD] * (width - len(i)) for i in ids])
    return ids, torch.from_numpy(images).permute(0, 3, 1, 2)


def flow_matching_loss(generator, encoder, ids, images, gen: torch.Generator):
    sigma = torch.sigmoid(torch.randn(len(images), generator=gen))
    eps = torch.randn(images.shape, generator=gen)
    s = sigma.view(-1, 1, 1, 1)
    v = generator((1 - s) * images + s * eps, sigma, encoder(ids), ids == PAD)
    return ((v - (eps - images)) ** 2).mean()


def pretrain(config, progress: bool = True) -> tuple[Path, bool]:
    """Train (or reuse) the base for `config`; returns its folder and whether it was reused."""
    out = base_dir(config)
    if (out / "manifest.json").is_file() and (out / "generator.safetensors").is_file():
        return out, True
    pc = config.pretrain
    torch.set_num_threads(pc.threads)
    generator, encoder = build_model(config, "generator"), build_text_encoder(config)
    ema = [copy.deepcopy(generator).requires_grad_(False), copy.deepcopy(encoder).requires_grad_(False)]
    params = [*generator.parameters(), *encoder.parameters()]
    optimizer = torch.optim.AdamW(params, lr=pc.lr, weight_decay=0.0)
    rng = np.random.default_rng(derive_seed(pc.seed, "pretrain-data"))
    gen = torch.Generator().manual_seed(derive_seed(pc.seed, "pretrain-noise"))
    max_words = max(r.max_new_tokens for r in config.experts.refiners)
    bar = tqdm(range(pc.steps), desc="pretrain", unit="it", disable=not progress, mininterval=2.0)
    for it in bar:
        for group in optimizer.param_groups:
            group["lr"] = pc.lr * 0.5 * (1 + math.cos(math.pi * it / pc.steps))
        batch = caption_batch(rng, pc.batch_size, config.task.image_size, pc.degraded_share,
                              len(config.experts.refiners), max_words)
        loss = flow_matching_loss(generator, encoder, *batch, gen)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        with torch.no_grad():
            for model, avg in zip((generator, encoder), ema):
                for p, q in zip(model.parameters(), avg.parameters()):
                    q.lerp_(p, 1 - pc.ema)
        if it % 50 == 0:
            bar.set_postfix(loss=f"{loss.item():.4f}")
    save_base(out, {"generator": ema[0], "text_encoder": ema[1]}, {"key": cache_key(config), **pc.model_dump()})
    return out, False


def refinement_batch(rng: np.random.Generator, n: int, degraded_share: float, max_new_tokens: int):
    """`n` (prompt ids, refinement tokens ending in <eos>) pairs: the detail segments of the
    pretraining captions, so a pretrained refiner writes what the base generator has seen."""
    prompts, tokens = [], []
    for _ in range(n):
        p = random_prompt(rng)
        words = detail_words(rng, bool(rng.random() < degraded_share), max_new_tokens - 1)
        prompts.append(list(p.ids))
        tokens.append([*(WORD_TO_ID[w] for w in words), EOS] + [PAD] * (max_new_tokens - 1 - len(words)))
    return prompts, torch.tensor(tokens)


def pretrain_refiner(config, expert_id: str, progress: bool = True) -> tuple[Path, bool]:
    """Supervised start for a refiner (as PromptRL starts from an instruct LM): maximum likelihood
    of the captions' detail segments. Cached by a hash like the base; returns (file, reused)."""
    refiner = config.expert(expert_id)
    out = Path(config.pretrain.out_dir) / f"refiner-{refiner_key(config, refiner)}"
    if (out / "manifest.json").is_file() and (out / "refiner.safetensors").is_file():
        return out / "refiner.safetensors", True
    pc = config.pretrain
    torch.set_num_threads(pc.threads)
    model = build_model(config, expert_id, fresh=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=pc.refiner_lr, weight_decay=0.0)
    rng = np.random.default_rng(derive_seed(pc.seed, "pretrain-refiner"))
    bar = tqdm(range(pc.refiner_steps), desc="refiner", unit="it", disable=not progress, mininterval=2.0)
    for _ in bar:
        prompts, tokens = refinement_batch(rng, pc.batch_size, pc.degraded_share, refiner.max_new_tokens)
        loss = -model.token_logprobs(prompts, tokens).sum() / (tokens != PAD).sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    save_base(out, {"refiner": model}, {"key": refiner_key(config, refiner), "final_loss": loss.item()})
    return out / "refiner.safetensors", False


def pretrain_all(config, progress: bool = True) -> tuple[list[str], bool]:
    """The base generator and text encoder, then every refiner's supervised start (each cached).
    Returns the `--set` overrides that start a run from them, and whether all were reused."""
    base, reused = pretrain(config, progress)
    overrides = [f"experts.generator.init={base.resolve() / 'generator.safetensors'}",
                 f"experts.text_encoder.init={base.resolve() / 'text_encoder.safetensors'}"]
    for i in range(len(config.experts.refiners)):
        path, again = pretrain_refiner(config, f"refiner_{i}", progress)
        overrides.append(f"experts.refiner_{i}.init={path.resolve()}")
        reused = reused and again
    return overrides, reused


def save_base(out: Path, models: dict, manifest: dict) -> None:
    """Written like a checkpoint (temporary folder, then renamed): a base is whole or absent."""
    with atomic_dir(out) as tmp:
        for name, model in models.items():
            state_file.write(tmp, name, {k: v.numpy() for k, v in model.state_dict().items()})
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
