"""`jointrl pretrain`: the base generator and text encoder, by flow matching on rendered pairs.

RL starts from a model that roughly works, as PromptRL starts from FLUX. Captions mix the full,
terse and paraphrased wordings of every category (under `task.rare_wording`, a
`pretrain.rare_caption_share` of them in rare synonyms, and half the refiners' examples); images
are the renderer's ground truth (under `shapes_video`, clips of task.num_frames frames of its
prompts, in full and terse wordings). The loss is rectified flow's: x_s = (1 - s) x + s eps,
target v = eps - x, s ~ logit-normal. The saved weights are an EMA of the trained ones, cached
under a hash of everything that shapes them, so a second call with the same config reuses the
first's result.
"""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from common.seeding import derive_seed
from driver.bases import base_dir, base_shaping, caption_details, digest, refiner_dir, refiner_shaping
from driver.checkpoint import atomic_dir
from experts import state_file
from experts.frontend import build_text_encoder
from experts.kinds import build_model
from tasks.shapes import (CATEGORIES, EOS, PAD, QUALITY_WORDS, SHAPES_VOCABULARY, STYLE_WORDS, WORD_TO_ID, Prompt,
                          make_prompt, paraphrase, rare_worded, render)
from tasks.shapes_video import VIDEO_CATEGORIES, make_video_prompt, render_clip

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


def segment_words(rng: np.random.Generator, prompt: Prompt, degraded: bool, max_words: int,
                  *, restate_share: float) -> list[str]:
    """`detail_words`, first restating one of the prompt's colours or shapes `restate_share` of the
    time, as a rewriting LM restates the request before adding detail."""
    words = detail_words(rng, degraded, max_words)
    if rng.random() < restate_share:
        said = sorted({w for o in prompt.objects for w in (o.colour, o.shape)})
        words = [str(rng.choice(said)), *words][:max_words]
    return words


def details(rng: np.random.Generator, prompt: Prompt, degraded: bool, max_segments: int, *, max_words: int,
            restate_share: float = 0.0) -> list[list[int]]:
    """Half the captions get 1 to `max_segments` segments of words after the prompt (each after a <sep>)."""
    if rng.random() < 0.5:
        return []
    segments = [segment_words(rng, prompt, degraded, max_words, restate_share=restate_share)
                for _ in range(rng.integers(1, max_segments + 1))]
    return [[WORD_TO_ID[w] for w in words] for words in segments]


REFINER_RARE_SHARE = 0.5  # under task.rare_wording a refiner's language knowledge holds both wordings alike


def random_prompt(rng: np.random.Generator, rare_share: float = 0.0) -> Prompt:
    """A prompt of a random category and wording (terse or full), paraphrased a third of the time,
    then said in rare synonyms a `rare_share` of the time (no draw for it when 0)."""
    return worded_prompt(rng, rare_share)[0]


def worded_prompt(rng: np.random.Generator, rare_share: float = 0.0) -> tuple[Prompt, Prompt]:
    """`random_prompt`'s prompt, and the same in its usual words (itself where it is not rare-worded)."""
    p = make_prompt(CATEGORIES[rng.integers(len(CATEGORIES))], rng, terse=bool(rng.integers(2)))
    p = paraphrase(p) if rng.random() < 1 / 3 else p
    return (rare_worded(p) if rare_share and rng.random() < rare_share else p), p


def random_video_prompt(rng: np.random.Generator):
    """A shapes_video prompt of a random category and wording (terse or full)."""
    return make_video_prompt(VIDEO_CATEGORIES[rng.integers(len(VIDEO_CATEGORIES))], rng, terse=bool(rng.integers(2)))


def caption_batch(rng: np.random.Generator, n: int, size: int, *, degraded_share: float = 0.0,
                  max_segments: int = 0, max_words: int = 0, restate_share: float = 0.0, max_len: int | None = None,
                  frames: int | None = None, rare_share: float = 0.0):
    """`n` rendered (caption ids, image in [-1, 1]) pairs over every category and wording; a
    `degraded_share` of the images are degraded, and some captions carry details (`details`); each
    caption is cut at `max_len` tokens as the runs' texts are (tasks.base.Vocabulary.compose). With
    `frames`: shapes_video clips of that many frames, as the flow's states (3, F, H, W); a `rare_share`
    of the captions in rare synonyms."""
    ids, images = [], []
    for _ in range(n):
        p = random_prompt(rng, rare_share) if frames is None else random_video_prompt(rng)
        degraded = bool(rng.random() < degraded_share)
        images.append(render(p, rng, size, degraded) if frames is None else
                      render_clip(p, rng, frames, size, degraded=degraded))
        extra = details(rng, p, degraded, max_segments, max_words=max_words,
                        restate_share=restate_share) if max_segments else []
        ids.append(list(SHAPES_VOCABULARY.compose(p.ids, extra, max_len)))  # the same special ids in every world
    images = torch.from_numpy(np.stack(images).astype(np.float32) / 127.5 - 1.0)
    width = max(map(len, ids))
    ids = torch.tensor([i + [PAD] * (width - len(i)) for i in ids])
    return ids, images.permute(0, 3, 1, 2) if frames is None else images.permute(0, 4, 1, 2, 3)


def flow_matching_loss(generator, encoder, ids, images, *, gen: torch.Generator):
    sigma = torch.sigmoid(torch.randn(len(images), generator=gen))
    eps = torch.randn(images.shape, generator=gen)
    s = sigma.view(-1, *[1] * (images.dim() - 1))
    v = generator((1 - s) * images + s * eps, sigma, encoder(ids), ids == PAD)
    return ((v - (eps - images)) ** 2).mean()


def pretrain(config, progress: bool = True) -> tuple[Path, bool]:
    """Train (or reuse) the base for `config`; returns its folder and whether it was reused."""
    out = base_dir(config)
    if (out / "manifest.json").is_file() and (out / "generator.safetensors").is_file():
        return out, True
    pc = config.pretrain
    torch.set_num_threads(pc.threads)
    generator, encoder = build_model(config, "generator", fresh=True), build_text_encoder(config, fresh=True)
    ema = [copy.deepcopy(generator).requires_grad_(False), copy.deepcopy(encoder).requires_grad_(False)]
    params = [*generator.parameters(), *encoder.parameters()]
    optimizer = torch.optim.AdamW(params, lr=pc.lr, weight_decay=0.0)
    rng = np.random.default_rng(derive_seed(pc.seed, "pretrain-data"))
    gen = torch.Generator().manual_seed(derive_seed(pc.seed, "pretrain-noise"))
    segments = caption_details(config)
    bar = tqdm(range(pc.steps), desc="pretrain", unit="it", disable=not progress, mininterval=2.0)
    for it in bar:
        for group in optimizer.param_groups:
            group["lr"] = pc.lr * 0.5 * (1 + math.cos(math.pi * it / pc.steps))
        batch = caption_batch(rng, pc.batch_size, config.task.image_size, degraded_share=pc.degraded_share,
                              max_segments=len(segments), max_words=max(segments, default=0),
                              restate_share=pc.restate_share, max_len=config.experts.text_encoder.max_sequence_length,
                              frames=config.task.num_frames,
                              rare_share=pc.rare_caption_share if config.task.rare_wording else 0.0)
        loss = flow_matching_loss(generator, encoder, *batch, gen=gen)
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
    shaping = base_shaping(config)
    save_base(out, {"generator": ema[0], "text_encoder": ema[1]},
              {"key": digest(shaping), "made_from": shaping, **pc.model_dump()})
    return out, False


def refinement_batch(rng: np.random.Generator, n: int, *, degraded_share: float, max_new_tokens: int,
                     restate_share: float = 0.0, rare_share: float = 0.0, rewrite_share: float = 0.0):
    """`n` (prompt ids, refinement tokens ending in <eos>) pairs: the detail segments of the
    pretraining captions, so a pretrained refiner writes what the base generator has seen; a
    `restate_share` of them first restate one of the prompt's colours or shapes in its usual word,
    a `rare_share` of the prompts being in rare synonyms. A `rewrite_share` of them are instead the
    whole request in its usual words, cut to `max_new_tokens` - 1 (no draw for it when 0)."""
    prompts, tokens = [], []
    for _ in range(n):
        p, usual = worded_prompt(rng, rare_share)
        if rewrite_share and rng.random() < rewrite_share:
            words = usual.text.split()[:max_new_tokens - 1]
        else:
            words = segment_words(rng, p, bool(rng.random() < degraded_share), max_new_tokens - 1,
                                  restate_share=restate_share)
        prompts.append(list(p.ids))
        tokens.append([*(WORD_TO_ID[w] for w in words), EOS] + [PAD] * (max_new_tokens - 1 - len(words)))
    return prompts, torch.tensor(tokens)


def pretrain_refiner(config, expert_id: str, progress: bool = True) -> tuple[Path, bool]:
    """Supervised start for a refiner (as PromptRL starts from an instruct LM): maximum likelihood
    of the captions' detail segments. Cached by a hash like the base; returns (file, reused)."""
    refiner = config.expert(expert_id)
    out = refiner_dir(config, expert_id)
    if (out / "manifest.json").is_file() and (out / "refiner.safetensors").is_file():
        return out / "refiner.safetensors", True
    pc = config.pretrain
    torch.set_num_threads(pc.threads)
    model = build_model(config, expert_id, fresh=True)
    model.temperature = 1.0  # the data's likelihood at temperature 1; `temperature` is how it is sampled
    optimizer = torch.optim.AdamW(model.parameters(), lr=pc.refiner_lr, weight_decay=0.0)
    rng = np.random.default_rng(derive_seed(pc.seed, "pretrain-refiner"))
    bar = tqdm(range(pc.refiner_steps), desc="refiner", unit="it", disable=not progress, mininterval=2.0)
    for _ in bar:
        prompts, tokens = refinement_batch(rng, pc.batch_size, degraded_share=pc.degraded_share,
                                           max_new_tokens=refiner.max_new_tokens, restate_share=pc.restate_share,
                                           rare_share=REFINER_RARE_SHARE if config.task.rare_wording else 0.0,
                                           rewrite_share=pc.rewrite_share_of(expert_id))
        loss = -model.token_logprobs(prompts, tokens).sum() / (tokens != PAD).sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    shaping = refiner_shaping(config, expert_id)
    save_base(out, {"refiner": model}, {"key": digest(shaping), "made_from": shaping, "final_loss": loss.item()})
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
    """Written like a checkpoint (temporary folder, then renamed, a sha256 per file in
    manifest.json): a base is whole or absent."""
    with atomic_dir(out) as tmp:
        files = {}
        for name, model in models.items():
            files.update(state_file.write(tmp, name, {k: v.numpy() for k, v in model.state_dict().items()}))
        (tmp / "manifest.json").write_text(json.dumps({**manifest, "files": dict(sorted(files.items()))}, indent=1))
