"""`jointrl pretrain`: a cached base that `train` and `eval` start from."""
import json

import numpy as np
import torch

import driver.cli as cli
from driver.pretrain import base_dir, caption_batch, flow_matching_loss, pretrain
from experts.build import build_model
from tests.conftest import make_config

SMALL = ["pretrain.steps=40", "pretrain.batch_size=8", "pretrain.threads=1", "evaluation.per_category=2",
         "experts.generator.model.d_model=32", "experts.text_encoder.d_model=32"]


def test_pretrain_caches_by_config_hash_and_train_starts_from_it(tmp_path):
    cfg = make_config(*SMALL, f"pretrain.out_dir={tmp_path}", preset="shapes-tiny")
    base, reused = pretrain(cfg, progress=False)
    assert not reused and {p.name for p in base.iterdir()} == {"generator.pt", "text_encoder.pt", "manifest.json"}
    stamp = (base / "generator.pt").stat().st_mtime_ns
    again, reused = pretrain(cfg, progress=False)
    assert again == base and reused and (base / "generator.pt").stat().st_mtime_ns == stamp
    other = make_config(*SMALL, "pretrain.lr=0.001", f"pretrain.out_dir={tmp_path}", preset="shapes-tiny")
    assert base_dir(other) != base
    started = make_config(*SMALL, f"experts.generator.init={base / 'generator.pt'}",
                          f"experts.text_encoder.init={base / 'text_encoder.pt'}", preset="shapes-tiny")
    saved = torch.load(base / "generator.pt", weights_only=True)["weights"]
    built = build_model(started, "generator").state_dict()
    assert all(torch.equal(saved[k], v) for k, v in built.items())
    assert not all(torch.equal(v, build_model(cfg, "generator").state_dict()[k]) for k, v in built.items())


def test_flow_matching_loss_falls_on_rendered_pairs():
    cfg = make_config(*SMALL, preset="shapes-tiny")
    torch.manual_seed(0)
    gen, enc = build_model(cfg, "generator"), build_model(cfg, "text_encoder")
    opt = torch.optim.AdamW([*gen.parameters(), *enc.parameters()], lr=3e-3)
    ids, images = caption_batch(np.random.default_rng(0), 16, 32)
    losses = []
    for i in range(60):
        loss = flow_matching_loss(gen, enc, ids, images, torch.Generator().manual_seed(i % 4))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert np.mean(losses[-10:]) < 0.6 * np.mean(losses[:10])


def test_cli_pretrain_then_eval_base(tmp_path, capsys):
    args = ["--config", "shapes-tiny", *[a for s in SMALL for a in ("--set", s)], "--set", f"pretrain.out_dir={tmp_path}"]
    assert cli.main(["pretrain", *args]) == 0
    out = capsys.readouterr().out
    assert "experts.generator.init=" in out and "held_out" in out
    base = next(tmp_path.glob("base-*"))
    report = json.loads((base / "eval.json").read_text())
    assert set(report["paraphrased"]) >= {"single_object", "position", "overall"}
    assert cli.main(["eval", "--base", str(base), *args]) == 0
    assert cli.main(["eval", "--base", str(tmp_path), *args]) == 2  # not a base folder
