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
from experts.build import build_model
from experts.seeding import derive_seed
from tasks.shapes import BOS, CATEGORIES, PAD, VOCAB, make_prompt, paraphrase, render

FORMAT = 1  # bump when what a base holds changes


def cache_key(config) -> str:
    shaping = {"format": FORMAT, "vocab": VOCAB, "task": config.task.model_dump(),
               "generator": config.experts.generator.model.model_dump(),
               "text_encoder": config.experts.text_encoder.model_dump(exclude={"init"}),
               "text_len": config.text_len(),
               "pretrain": config.pretrain.model_dump(exclude={"out_dir", "threads"})}
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:12]


def base_dir(config) -> Path:
    return Path(config.pretrain.out_dir) / f"base-{cache_key(config)}"


def caption_batch(rng: np.random.Generator, n: int, size: int):
    """`n` rendered (caption ids, image in [-1, 1]) pairs over every category and wording."""
    prompts = []
    for _ in range(n):
        p = make_prompt(CATEGORIES[rng.integers(len(CATEGORIES))], rng, terse=bool(rng.integers(2)))
        prompts.append(paraphrase(p) if rng.random() < 1 / 3 else p)
    images = np.stack([render(p, rng, size) for p in prompts]).astype(np.float32) / 127.5 - 1.0
    ids = [[BOS, *p.ids] for p in prompts]
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
    if (out / "manifest.json").is_file():
        return out, True
    pc = config.pretrain
    torch.set_num_threads(pc.threads)
    generator, encoder = build_model(config, "generator"), build_model(config, "text_encoder")
    ema = [copy.deepcopy(generator).requires_grad_(False), copy.deepcopy(encoder).requires_grad_(False)]
    params = [*generator.parameters(), *encoder.parameters()]
    optimizer = torch.optim.AdamW(params, lr=pc.lr, weight_decay=0.0)
    rng = np.random.default_rng(derive_seed(pc.seed, "pretrain-data"))
    gen = torch.Generator().manual_seed(derive_seed(pc.seed, "pretrain-noise"))
    bar = tqdm(range(pc.steps), desc="pretrain", unit="it", disable=not progress, mininterval=2.0)
    for it in bar:
        for group in optimizer.param_groups:
            group["lr"] = pc.lr * 0.5 * (1 + math.cos(math.pi * it / pc.steps))
        loss = flow_matching_loss(generator, encoder, *caption_batch(rng, pc.batch_size, config.task.image_size), gen)
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


def save_base(out: Path, models: dict, manifest: dict) -> None:
    """Written like a checkpoint (temporary folder, then renamed): a base is whole or absent."""
    with atomic_dir(out) as tmp:
        for name, model in models.items():
            torch.save({"version": 0, "weights": model.state_dict()}, tmp / f"{name}.pt")
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
