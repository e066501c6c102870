"""Pretrained bases: what `jointrl pretrain` writes, named by a hash of everything that shapes it,
and how a config starts from one (`experts.base`).

A pretrain output folder holds `base-<hash>/` (the generator and its text encoder) and
`refiner-<hash>/` (a refiner's supervised start), each with a manifest of its files' sha256 and
of the settings its hash covers (`made_from`). A config with `experts.base` starts every expert
whose `init` it does not set from the file made for exactly its settings; where the folder holds
none, the error names the settings that differ.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from driver.overrides import flat
from tasks import refiner_vocabulary, text_vocabulary
from tasks.shapes import MAX_PROMPT_WORDS

FORMAT = 3  # bump when what a base holds changes


def caption_details(config) -> list[int]:
    """The detail segments a pretraining caption may carry after its prompt, as the most words of
    each: segments as long as the longest refinement (the refiners' largest max_new_tokens), as many
    as fit the text encoder's `max_sequence_length` after a full prompt. Not the number of refiners:
    one base serves any number of them, the text a run composes being cut at the same length."""
    words = max(r.max_new_tokens for r in config.experts.refiners)
    room = config.experts.text_encoder.max_sequence_length - 1 - MAX_PROMPT_WORDS
    return [words] * max(0, room // (1 + words))


def base_shaping(config) -> dict:
    """Everything that shapes the base generator and text encoder (`text_len`: the encoder's
    max_sequence_length; `details`: caption_details). A square image task leaves out `num_frames` and
    `image_width`, so that image bases made before videos existed keep their hash; `compose` is what a
    run feeds the base, not how it was made; nor is `rare_wording`'s share of training prompts: a base
    made for it holds the rare words (`vocab`) and saw them in `rare_caption_share` of its captions."""
    unset = {k for k in ("num_frames", "image_width") if getattr(config.task, k) is None}
    task = config.task.model_dump(exclude={"compose", "rare_wording", *unset})
    rare = {"rare_caption_share": config.pretrain.rare_caption_share} if config.task.rare_wording else {}
    return {"format": FORMAT, "vocab": list(text_vocabulary(config.task).words), "task": task, **rare,
            "generator": config.experts.generator.model.model_dump(),
            "text_encoder": config.experts.text_encoder.model_dump(exclude={"init", "max_sequence_length"}),
            "text_len": config.experts.text_encoder.max_sequence_length,
            "details": caption_details(config),
            "pretrain": config.pretrain.model_dump(exclude={"out_dir", "threads", "refiner_steps", "refiner_lr",
                                                            "rare_caption_share", "rewrite_share",
                                                            "rewrite_shares"})}


def refiner_shaping(config, refiner_id: str) -> dict:
    """Everything that shapes a refiner's supervised start (not its sampling temperature: the start
    is learnt at temperature 1, as a pretrained LM's weights are, and sampled at any). Its rewrite
    share is named only where it is not 0, so the starts made before it existed keep their hash;
    not the refiner's id: two refiners of one shaping share one start."""
    refiner, share = config.expert(refiner_id), config.pretrain.rewrite_share_of(refiner_id)
    rewrite = {"rewrite_share": share} if share else {}
    return {"format": FORMAT, "vocab": list(refiner_vocabulary(config.task).words), "model": refiner.model.model_dump(),
            "max_new_tokens": refiner.max_new_tokens,
            "pretrain": {**config.pretrain.model_dump(include={"refiner_steps", "refiner_lr", "batch_size", "seed",
                                                                 "degraded_share", "restate_share"}), **rewrite}}


def digest(shaping: dict) -> str:
    return hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:12]


def base_dir(config, out_dir: str | Path | None = None) -> Path:
    """Where the base for `config` is (or goes) under `out_dir` (default `pretrain.out_dir`)."""
    return Path(out_dir or config.pretrain.out_dir) / f"base-{digest(base_shaping(config))}"


def refiner_dir(config, refiner_id: str, out_dir: str | Path | None = None) -> Path:
    return Path(out_dir or config.pretrain.out_dir) / f"refiner-{digest(refiner_shaping(config, refiner_id))}"


def init_files(config, out_dir: str | Path, wanted: set[str]) -> dict[str, Path]:
    """`experts.<id>.init` (and `experts.text_encoder.init`) for every expert named in `wanted` (those
    whose init the config does not set), from the pretrain output folder `out_dir`; a ValueError
    naming the settings that differ where it holds none."""
    if not any(Path(out_dir).glob("*/manifest.json")):
        raise ValueError(f"'{out_dir}' holds nothing `jointrl pretrain` made (no base-<hash>/ or "
                         f"refiner-<hash>/ folder with its manifest.json); make one there with `jointrl pretrain "
                         f"--set pretrain.out_dir={out_dir}`, or start from random weights with experts.base=null")
    base = base_dir(config, out_dir)
    files, problems = {}, []
    if config.experts.generator.model.kind in ("tiny_dit", "tiny_video_dit"):  # a base holds tiny models only
        files = {name: base / f"{name}.safetensors" for name in ("generator", "text_encoder") if name in wanted}
    if files and not base.is_dir():
        problems = [differences(out_dir, "base-", base_shaping(config), "the generator", keys={
            "generator.": "experts.generator.model.", "text_encoder.": "experts.text_encoder.",
            "text_len": "experts.text_encoder.max_sequence_length",
            "details.": "the words (the refiners' largest max_new_tokens) of the pretraining captions' detail "
                        "segment "})]
    for eid, refiner in config.experts.active_refiners().items():
        if refiner.model.kind != "tiny_lm" or eid not in wanted:
            continue
        folder = refiner_dir(config, eid, out_dir)
        files[eid] = folder / "refiner.safetensors"
        if not folder.is_dir():
            problems.append(differences(out_dir, "refiner-", refiner_shaping(config, eid), eid,
                                        keys={"model.": f"experts.{eid}.model.",
                                              "max_new_tokens": f"experts.{eid}.max_new_tokens"}))
    if problems:
        raise ValueError("; ".join(dict.fromkeys(problems)) + ". Make one with `jointrl pretrain` and these "
                         "settings, or start from random weights with experts.base=null")
    return files


def differences(out_dir: str | Path, prefix: str, shaping: dict, what: str, *, keys: dict[str, str]) -> str:
    """Why `out_dir` holds nothing for `what`: the settings in which its nearest one differs, by
    their config keys (`keys`: the start of a setting's name -> the start of its key)."""
    manifests = sorted(Path(out_dir).glob(f"{prefix}*/manifest.json"))
    made = [m for m in map(made_from, manifests) if m is not None]
    if not made:
        return f"'{out_dir}' holds no readable pretrained {prefix.rstrip('-')} (for {what})"
    want = flat(shaping)
    nearest = min((flat(m) for m in made), key=lambda m: sum(m.get(k) != v for k, v in want.items()))
    def key(name: str) -> str:
        start = next((s for s in keys if name.startswith(s)), None)
        return keys[start] + name[len(start):] if start else name
    diff = [f"{key(k)} {nearest.get(k)!r} there, {v!r} here" for k, v in want.items() if nearest.get(k) != v]
    diff += [f"{key(k)} {v!r} there, not a setting here" for k, v in nearest.items() if k not in want]
    return f"'{out_dir}' holds no pretrained {prefix.rstrip('-')} for {what}: it was made with " + ", ".join(diff)


def made_from(manifest: Path) -> dict | None:
    """The settings a manifest says its files were made from; None where it cannot be read (a
    damaged or foreign manifest is no nearest candidate, and is checked when it is loaded)."""
    try:
        made = json.loads(manifest.read_text()).get("made_from")
    except (OSError, ValueError, AttributeError):
        return None
    return made if isinstance(made, dict) else None
