"""`jointrl pretrain`: a cached base that `train` and `eval` start from."""
import json

import numpy as np
import torch

import driver.cli as cli
from driver.bases import base_dir
from driver.commands.pretrain import caption_batch, flow_matching_loss, pretrain, pretrain_all
from experts import state_file
from experts.frontend import build_text_encoder
from experts.kinds import build_model
from tasks.shapes import EOS, PAD, QUALITY_WORDS, SEP, STYLE_WORDS, VOCAB, colour_map, prompt_set
from tests.conftest import make_config

SMALL = ["pretrain.steps=40", "pretrain.batch_size=8", "pretrain.threads=1", "evaluation.per_category=2",
         "experts.generator.model.d_model=32", "experts.text_encoder.d_model=32"]


def test_pretrain_caches_by_config_hash_and_train_starts_from_it(tmp_path):
    cfg = make_config(*SMALL, f"pretrain.out_dir={tmp_path}", preset="shapes-tiny")
    base, reused = pretrain(cfg, progress=False)
    assert not reused and {p.name for p in base.iterdir()} == {"generator.safetensors", "generator.json",
                                                         "text_encoder.safetensors", "text_encoder.json",
                                                         "manifest.json"}
    stamp = (base / "generator.safetensors").stat().st_mtime_ns
    again, reused = pretrain(cfg, progress=False)
    assert again == base and reused and (base / "generator.safetensors").stat().st_mtime_ns == stamp
    other = make_config(*SMALL, "pretrain.lr=0.001", f"pretrain.out_dir={tmp_path}", preset="shapes-tiny")
    assert base_dir(other) != base
    started = make_config(*SMALL, f"experts.generator.init={base / 'generator.safetensors'}",
                          f"experts.text_encoder.init={base / 'text_encoder.safetensors'}", preset="shapes-tiny")
    saved = state_file.read_weights(base / "generator.safetensors")
    built = build_model(started, "generator").state_dict()
    assert all(torch.equal(saved[k], v) for k, v in built.items())
    assert not all(torch.equal(v, build_model(cfg, "generator").state_dict()[k]) for k, v in built.items())


def test_refiners_start_from_a_cached_supervised_base_that_writes_style_details(tmp_path):
    cfg = make_config(*SMALL, "pretrain.refiner_steps=150", f"pretrain.out_dir={tmp_path}",
                      "experts.refiner_2.temperature=0.7", preset="shapes-tiny")
    overrides, reused = pretrain_all(cfg, progress=False)
    assert not reused and pretrain_all(cfg, progress=False) == (overrides, True)
    inits = dict(o.split("=", 1) for o in overrides)
    assert len({inits[f"experts.refiner_{i}.init"] for i in range(3)}) == 1   # one base per refiner model,
    # whatever temperature each samples at
    started = make_config(*SMALL, *overrides, preset="shapes-tiny")
    model = build_model(started, "refiner_1")
    asked = prompt_set(32, 0)
    prompts = [list(p.ids) for p in asked]
    tokens, _, _ = model.sample(prompts, torch.rand(32, model.max_new_tokens, generator=torch.Generator().manual_seed(0)))
    said = [(VOCAB[t], {w for o in p.objects for w in (o.colour, o.shape)}) for row, p in zip(tokens.tolist(), asked)
            for t in row if t not in (PAD, EOS)]
    # what the captions' details hold: style words, some restating one of the prompt's colours or shapes
    assert sum(w in STYLE_WORDS or w in own for w, own in said) > 0.9 * len(said)
    assert (tokens == EOS).any(1).float().mean() > 0.9                      # and it stops by itself
    fresh = build_model(cfg, "refiner_1").state_dict()
    assert not all(torch.equal(v, fresh[k]) for k, v in model.state_dict().items())


def test_flow_matching_loss_falls_on_rendered_pairs():
    cfg = make_config(*SMALL, preset="shapes-tiny")
    torch.manual_seed(0)
    gen, enc = build_model(cfg, "generator"), build_text_encoder(cfg)
    opt = torch.optim.AdamW([*gen.parameters(), *enc.parameters()], lr=3e-3)
    ids, images = caption_batch(np.random.default_rng(0), 16, 32)
    losses = []
    for i in range(60):
        loss = flow_matching_loss(gen, enc, ids, images, gen=torch.Generator().manual_seed(i % 4))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert np.mean(losses[-10:]) < 0.6 * np.mean(losses[:10])


def test_only_clean_images_are_captioned_with_quality_words():
    ids, images = caption_batch(np.random.default_rng(0), 300, 32, degraded_share=0.3, max_segments=3, max_words=6)
    pixels = ((images.permute(0, 2, 3, 1).numpy() + 1) * 127.5).round().astype(np.uint8)
    clean = np.array([(colour_map(im) >= 0).sum() > 10 for im in pixels])   # the detector sees colours
    quality = np.array([any(VOCAB[i] in QUALITY_WORDS for i in row.tolist()) for row in ids])
    separated = (ids == SEP).any(1).numpy()
    assert 0.2 < 1 - clean.mean() < 0.4 and quality.any() and separated[~clean].any()
    assert not (quality & ~clean).any()               # a degraded image never carries a quality word
    assert quality[clean].mean() > 0.2


def test_cli_pretrain_then_eval_base(tmp_path, capsys):
    args = ["--config", "shapes-tiny", *[a for s in SMALL for a in ("--set", s)], "--set", f"pretrain.out_dir={tmp_path}"]
    assert cli.main(["pretrain", *args]) == 0
    out = capsys.readouterr().out
    assert "experts.generator.init=" in out and "held_out" in out
    base = next(tmp_path.glob("base-*"))
    report = json.loads((base / "eval.json").read_text())["sets"]
    assert set(report["paraphrased"]["unrefined"]["image/strict"]) >= {"single_object", "position", "overall"}
    assert cli.main(["eval", "--base", str(base), *args]) == 0
    samples = read_png(base / "eval_samples.png")
    assert samples.shape[0] == (6 * 34 + 2) * 4  # one row of samples per category
    assert cli.main(["eval", "--base", str(tmp_path), *args]) == 2  # not a base folder


def read_png(path):
    """Decode an 8-bit RGB PNG written without filters (as driver.images writes it)."""
    import struct
    import zlib
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = struct.unpack(">II", data[16:24])
    idat, pos = b"", 8
    while pos < len(data):
        n, kind = struct.unpack(">I", data[pos:pos + 4])[0], data[pos + 4:pos + 8]
        if kind == b"IDAT":
            idat += data[pos + 8:pos + 8 + n]
        pos += 12 + n
    rows = np.frombuffer(zlib.decompress(idat), np.uint8).reshape(h, 1 + 3 * w)
    return rows[:, 1:].reshape(h, w, 3)


def test_eval_writes_a_sample_grid_one_row_per_category(tmp_path):
    from driver.images import grid, write_png
    images = np.random.default_rng(0).uniform(-1, 1, (12, 3, 32, 32)).astype(np.float32)
    pic = read_png(write_png(tmp_path / "g.png", grid(images, cols=6)))
    assert pic.shape == ((2 * 34 + 2) * 4, (6 * 34 + 2) * 4, 3)
    assert pic.std() > 10  # not blank
    np.testing.assert_array_equal(pic[8:8 + 128:4, 8:8 + 128:4], grid(images[:1], cols=1)[8:136:4, 8:136:4])


def test_cli_pretrain_refiners_makes_only_the_refiners_starts(tmp_path, capsys):
    """`jointrl pretrain --refiners`: each refiner's supervised start (one per shaping), no base."""
    args = ["--config", "shapes-tiny", "--refiners", "--set", "pretrain.refiner_steps=5", "--set",
            f"pretrain.out_dir={tmp_path}", "--set", "experts.refiner_2.max_new_tokens=8"]
    assert cli.main(["pretrain", *args]) == 0
    out = capsys.readouterr().out
    assert [p.name.split("-")[0] for p in sorted(tmp_path.iterdir())] == ["refiner", "refiner"]
    assert out.count("made: --set experts.refiner_") == 2 and "refiner_1's supervised start reused" in out
