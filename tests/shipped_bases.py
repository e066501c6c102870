"""The check every shipped pretrained base passes (configs/bases/<preset>/, as `jointrl pretrain`
writes it): its files are the ones its manifests list, made for exactly the preset's settings, a
few MB in all, and the preset's experts load them bit for bit."""
import json
from pathlib import Path

import torch

from driver.bases import base_dir, base_shaping, digest, refiner_dir, refiner_shaping
from experts.state_file import sha256
from driver.preflight import load_config
from experts import state_file
from experts.frontend import build_text_encoder
from experts.kinds import build_model


REWRITER = ("experts.n_refiners=1", "experts.refiner_0.max_new_tokens=17", "pretrain.rewrite_share=1.0")


def check_shipped_base(preset: str, shipped: Path, max_mib: float, overrides: tuple[str, ...] = (),
                       rewriter: bool = False) -> tuple[Path, Path]:
    """Assert the base in `shipped` is the one `preset` (with `overrides`) starts from, and (with
    `rewriter`) that the only other folder is the supervised start of bench/learning.py's
    promptrl_rewrite rewriter (REWRITER) made for it; (its base folder, its refiner folder), for the
    caller's own checks of its eval.json."""
    config = load_config(preset, list(overrides))
    base, refiner = base_dir(config, shipped), refiner_dir(config, "refiner_0", shipped)
    made_for = {base: base_shaping(config), refiner: refiner_shaping(config, "refiner_0")}
    if rewriter:
        rewriting = load_config(preset, [*overrides, "experts.base=null", *REWRITER])
        made_for[refiner_dir(rewriting, "refiner_0", shipped)] = refiner_shaping(rewriting, "refiner_0")
    assert sorted(p for p in shipped.iterdir() if p.is_dir()) == sorted(made_for)
    assert sum(f.stat().st_size for f in shipped.rglob("*") if f.is_file()) < max_mib * 2 ** 20
    for folder, shaping in made_for.items():
        manifest = json.loads((folder / "manifest.json").read_text())
        assert manifest["made_from"] == shaping
        assert folder.name.endswith(manifest["key"]) and manifest["key"] == digest(manifest["made_from"])
        assert {name: sha256(folder / name) for name in manifest["files"]} == manifest["files"]
    assert config.experts.generator.init == str(base / "generator.safetensors")
    assert config.experts.text_encoder.init == str(base / "text_encoder.safetensors")
    assert {r.init for r in config.experts.refiners} == {str(refiner / "refiner.safetensors")}
    last_refiner = config.experts.refiner_id(len(config.experts.refiners) - 1)
    for built, file in ((build_model(config, "generator"), base / "generator.safetensors"),
                        (build_text_encoder(config), base / "text_encoder.safetensors"),
                        (build_model(config, last_refiner), refiner / "refiner.safetensors")):
        saved = state_file.read_weights(file)
        assert all(torch.equal(saved[k], v) for k, v in built.state_dict().items()), file
    return base, refiner
