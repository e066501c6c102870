"""`jointrl export RUN_DIR --out DIR [--step N] [--merge-lora]`: a run's trained models in the formats
the ecosystem loads, with a model card.

Per expert, in `DIR/<expert id>/`:
- a diffusers generator (`diffusers_flow`): under LoRA, diffusers' LoRA file
  (`pytorch_lora_weights.safetensors`, written by the family pipeline's own `save_lora_weights`
  with the adapter's rank and alpha), which `pipe.load_lora_weights(DIR/generator)` loads into the
  base pipeline; a full fine-tune (or LoRA merged into the base, `--merge-lora`) as the transformer
  folder the family's transformer class loads with `from_pretrained`, the base's other components
  named in the card, not copied. A velocity holding Wan2.2-A14B's low-noise transformer writes it
  to `transformer_2/` (diffusers loads its LoRA with `load_into_transformer_2=True`);
- a Hugging Face refiner (`hf_causal_lm`): under LoRA, a PEFT adapter folder naming its base model
  and revision (`PeftModel.from_pretrained`; the format vLLM's `LoRARequest` reads); a full fine-tune (or merged) as a
  folder `AutoModelForCausalLM.from_pretrained` and vLLM load. Either with its tokenizer and chat
  template, a generation_config.json that samples as the run did (temperature, no top-k or top-p,
  max_new_tokens), and `refiner.json` with the system prompt and answer tag it was trained with;
- a model of this project's own (the shapes world's tiny DiT and LM): its weights as safetensors,
  which only jointrl loads (said in the card).

The models are built as the run's rollout workers build them (experts/kinds.py `build_model`, in
the model's dtype, a LoRA adapter in fp32) and given the checkpoint's weights, so the exported
files hold the numbers the run sampled with.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from common.config import SettingError
from driver.checkpoint import all_checkpoints, checkpoint_path, latest, manifest, step_of, verify
from driver.metrics import parse
from experts import state_file


class ExportError(SettingError):
    """What cannot be exported as asked (exit 2)."""


def checkpoint_to_export(run_dir: Path, step: int | None) -> Path:
    if step is None:
        return latest(run_dir)
    ckpt = checkpoint_path(run_dir, step)
    if not ckpt.is_dir():
        have = ", ".join(str(step_of(c)) for c in all_checkpoints(run_dir)) or "none"
        raise ExportError(f"--step {step}: '{run_dir}' has no checkpoint of step {step} (steps kept: {have})")
    return ckpt


def empty_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out '{out}' already holds files: export writes into a new or empty folder")
    out.mkdir(parents=True, exist_ok=True)


def trained_model(config, expert_id: str, weights: dict) -> torch.nn.Module:
    """Expert `expert_id`'s model as a rollout worker builds it, holding `weights`."""
    from experts.kinds import build_model
    from experts.weights import load, model_tensors
    model = build_model(config, expert_id).eval()
    load(model, model_tensors(model, weights))
    return model


def export_diffusers_generator(velocity, folder: Path, merge_lora: bool) -> list[str]:
    """The transformer(s) the velocity trains: a diffusers LoRA file, or a transformer folder."""
    import diffusers
    from peft import get_peft_model_state_dict
    pipeline = getattr(diffusers, velocity.index["_class_name"])
    written = []
    for name in ("transformer", "transformer_2"):
        transformer = velocity._modules.get(name)
        if transformer is None:
            continue
        into = lora_folder(velocity, name, folder)
        if velocity.lora and not merge_lora:
            config = transformer.peft_config["default"]
            metadata = {"r": config.r, "lora_alpha": config.lora_alpha,
                        "target_modules": sorted(config.target_modules), "lora_dropout": config.lora_dropout}
            layers = {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(transformer).items()}
            pipeline.save_lora_weights(into, transformer_lora_layers=layers,
                                       transformer_lora_adapter_metadata=metadata)
            written.append(f"{into / 'pytorch_lora_weights.safetensors'}: {name}'s LoRA adapter "
                           f"(r={config.r}, alpha={config.lora_alpha:g})")
        else:
            if velocity.lora:
                transformer.fuse_lora(lora_scale=1.0)
                transformer.unload_lora()
            transformer.save_pretrained(folder / name)
            written.append(f"{folder / name}: {type(transformer).__name__}"
                           f"{' with its LoRA merged' if velocity.lora else ''}")
    return written


def lora_folder(velocity, name: str, folder: Path) -> Path:
    """Where transformer `name`'s LoRA file goes: the expert's folder for its first transformer,
    `transformer_2/` beside it for a second (Wan2.2-A14B's low-noise one, held with the high)."""
    return folder if name == "transformer" or "transformer" not in velocity._modules else folder / name


def export_hf_refiner(refiner, spec, folder: Path, merge_lora: bool) -> list[str]:
    """A PEFT adapter folder, or the whole LM; with the tokenizer, how the run sampled and its system prompt."""
    from transformers import GenerationConfig
    m = spec.model
    if refiner.lora and not merge_lora:
        adapter = refiner.lm.peft_config["default"]
        refiner.lm.save_pretrained(folder)
        saved = json.loads((folder / "adapter_config.json").read_text())  # the base by its name, not this cache's
        saved.update(base_model_name_or_path=m.path, revision=m.revision)
        (folder / "adapter_config.json").write_text(json.dumps(saved, indent=2) + "\n")
        what = f"a PEFT LoRA adapter (r={adapter.r}, alpha={adapter.lora_alpha:g}) on {m.path}"
    else:
        lm = refiner.lm.merge_and_unload() if refiner.lora else refiner.lm
        lm.save_pretrained(folder)
        what = f"{type(lm).__name__}{' with its LoRA merged' if refiner.lora else ''}"
    refiner.tokenizer.save_pretrained(folder)
    GenerationConfig(do_sample=True, temperature=spec.temperature, top_k=0, top_p=1.0,
                     max_new_tokens=spec.max_new_tokens, eos_token_id=refiner.eos,
                     pad_token_id=refiner.pad).save_pretrained(folder)
    (folder / "refiner.json").write_text(json.dumps({"system_prompt": m.system_prompt, "answer_tag": m.answer_tag,
                                                      "max_new_tokens": spec.max_new_tokens,
                                                      "temperature": spec.temperature}, indent=2) + "\n")
    return [f"{folder}: {what}, its tokenizer, generation_config.json and refiner.json"]


def export_own_model(model, folder: Path) -> list[str]:
    from safetensors.torch import save_file
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors")
    return [f"{folder / 'model.safetensors'}: {type(model).__name__}, a model of jointrl's own (only jointrl loads it)"]


def export(run_dir: Path, out: Path, *, step: int | None, merge_lora: bool, config) -> list[str]:
    """Every expert of the run at its checkpoint of `step` (None: the latest) into `out`, and the
    card; the lines of what was written."""
    ckpt = checkpoint_to_export(run_dir, step)
    ids = config.experts.ids()
    verify(ckpt, ids)
    empty_out(out)
    written, notes = [], []
    for eid in ids:
        spec = config.expert(eid)
        kind = spec.model.kind
        weights = state_file.read_weights(ckpt / f"{eid}.safetensors")
        model = trained_model(config, eid, weights)
        folder = out / eid
        folder.mkdir(parents=True)
        if kind == "diffusers_flow":
            written += export_diffusers_generator(model, folder, merge_lora)
            if "transformer_2" in model._modules:
                low = lora_folder(model, "transformer_2", folder)
                notes.append(f"Wan2.2-A14B's low-noise transformer is in `{low.relative_to(out)}/`: "
                             + (f'`pipe.load_lora_weights("{low.relative_to(out)}", load_into_transformer_2=True)`'
                                if model.lora and not merge_lora else
                                f'`AutoModel.from_pretrained("{eid}/transformer_2")`, passed as `transformer_2=`') + ".")
        elif kind == "hf_causal_lm":
            written += export_hf_refiner(model, spec, folder, merge_lora)
        else:
            written += export_own_model(model, folder)
    shutil.copy(run_dir / "config.yaml", out / "jointrl_config.yaml")
    (out / "README.md").write_text(model_card(run_dir, ckpt, config=config, merge_lora=merge_lora, notes=notes))
    return [*written, f"{out / 'README.md'}: the model card", f"{out / 'jointrl_config.yaml'}: the run's config"]


def rows_before(run_dir: Path, step: int) -> list[dict]:
    """The run's metrics rows of the steps checkpoint `step` holds (a line cut short by a kill is skipped)."""
    path = run_dir / "metrics.jsonl"
    rows = (parse(line) for line in (path.read_text().splitlines() if path.is_file() else []))
    return [r for r in rows if r and r.get("step", 0) < step]


def last_held_out(rows: list[dict]) -> tuple[int | None, dict]:
    """(the step, its eval/* figures) of the last evaluation among `rows`."""
    found, figures = None, {}
    for row in rows:
        if any(k.startswith("eval/") for k in row):
            found, figures = row["step"], {k: v for k, v in row.items() if k.startswith("eval/")}
    return found, figures


def model_card(run_dir: Path, ckpt: Path, *, config, merge_lora: bool, notes: list[str]) -> str:
    step = manifest(ckpt)["step"]
    rows = rows_before(run_dir, step)
    rollouts = max((r.get("rollouts", 0) for r in rows), default=0)  # metrics' `rollouts` is a running total
    lines = [f"# {config.trainer.run_name or run_dir.name}: models exported by jointrl", "",
             f"Trained jointly from one reward by jointrl (N prompt refiners and one flow-matching generator, "
             f"Flow-GRPO arXiv 2505.05470 for the generator, GRPO arXiv 2402.03300 for the refiners) for "
             f"{step} step(s), {rollouts} rollouts, exported from `{ckpt.name}` of `{run_dir}`.",
             "", "| expert | model kind | base | revision | trained | folder |", "|---|---|---|---|---|---|"]
    for eid in config.experts.ids():
        m = config.expert(eid).model
        trained = "LoRA " + ("merged" if merge_lora else f"r={m.lora.r} alpha={m.lora.alpha:g}") \
            if getattr(m, "lora", None) else "full fine-tune"
        lines.append(f"| {eid} | {m.kind} | {getattr(m, 'path', '(jointrl own)')} | {getattr(m, 'revision', None) or '-'} "
                     f"| {trained} | `{eid}/` |")
    lines += ["", "Reward terms (weight): " + ", ".join(f"{name} ({t.weight:g}, fn {t.fn})"
                                                       for name, t in config.reward.terms.items()) + "."]
    at, figures = last_held_out(rows)
    if figures:
        lines += ["", f"Last held-out figures (step {at}):", ""] + [f"- {k}: {v:.4f}" for k, v in sorted(figures.items())]
    lines += ["", "## Sampling with the exported models", "", *usage(config, merge_lora), *notes, "",
              "The run's whole config is `jointrl_config.yaml`.", ""]
    return "\n".join(lines)


def usage(config, merge_lora: bool) -> list[str]:
    g = config.experts.generator.model
    out = []
    if g.kind == "diffusers_flow":
        if g.lora and not merge_lora:
            load = ["pipe = DiffusionPipeline.from_pretrained(BASE)", 'pipe.load_lora_weights("generator")']
        else:
            load = ["from diffusers import AutoModel",
                    'transformer = AutoModel.from_pretrained("generator/transformer")',
                    "pipe = DiffusionPipeline.from_pretrained(BASE, transformer=transformer)"]
        out += ["```python", "from diffusers import DiffusionPipeline", f'BASE = "{g.path}"', *load,
                f"image = pipe(prompt, guidance_scale={g.guidance_scale}).images[0]", "```"]
    else:
        out += ["The generator is a model of jointrl's own: `jointrl sample` draws with it."]
    for eid, r in config.experts.active_refiners().items():
        if r.model.kind != "hf_causal_lm":
            continue
        load = (f'lm = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("{r.model.path}"), "{eid}")'
                if r.model.lora and not merge_lora else f'lm = AutoModelForCausalLM.from_pretrained("{eid}")')
        out += ["", f"Refiner `{eid}` (its system prompt is in `{eid}/refiner.json`):", "", "```python",
                "import json", "from transformers import AutoModelForCausalLM, AutoTokenizer",
                *(["from peft import PeftModel"] if r.model.lora and not merge_lora else []), load,
                f'tok = AutoTokenizer.from_pretrained("{eid}")',
                f'system = json.load(open("{eid}/refiner.json"))["system_prompt"]',
                'messages = ([{"role": "system", "content": system}] if system else []) + '
                '[{"role": "user", "content": prompt}]',
                "ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors='pt')",
                "refined = tok.decode(lm.generate(ids)[0, ids.shape[1]:], skip_special_tokens=True)", "```"]
    return out
