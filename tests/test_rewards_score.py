"""`jointrl score`: a folder of images scored with one reward term, as a person checks a reward
before training with it: the pixels the term sees are the file's, images pair with prompts in name
order, the config's term or a built-in's defaults, readable and JSON output, and every bad input
refused with exit 2 naming the file or key before any model loads."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from driver import cli
from driver.commands.score import chunks, natural_key, read_image, term_config
from tasks.base import from_uint8, to_uint8
from tasks.prompt_data import load_prompts
from tasks.rewards.term import build_scorer
from tests.rendered_text import LAYOUTS, PHRASES, rendered


def test_the_term_sees_the_files_pixels():
    every = np.arange(256, dtype=np.uint8).reshape(16, 16, 1).repeat(3, axis=2)
    assert np.array_equal(to_uint8(from_uint8(every)), every)
    assert from_uint8(every).min() > -1 and from_uint8(every).max() == 1


def test_name_order_counts_numbers_by_value_and_batches_keep_one_size():
    names = ["img10.png", "img2.png", "b.jpg", "img1.png", "a.png"]
    assert [p.name for p in sorted(map(Path, names), key=natural_key)] == \
        ["a.png", "b.jpg", "img1.png", "img2.png", "img10.png"]
    sizes = [(32, 32)] * 3 + [(40, 40)] * 2 + [(32, 32)]
    assert chunks(sizes, 2) == [slice(0, 2), slice(2, 3), slice(3, 5), slice(5, 6)]


def write(folder: Path, images: list[np.ndarray], names: list[str]) -> Path:
    folder.mkdir(exist_ok=True)
    for image, name in zip(images, names):
        Image.fromarray(to_uint8(image)).save(folder / name)
    return folder


@pytest.fixture(scope="module")
def signs(tmp_path_factory):
    """Four rendered phrases (two PNG, two JPEG, named so that name order is not string order) and
    their prompts, the second and third swapped in the file names' order."""
    root = tmp_path_factory.mktemp("signs")
    rng = np.random.default_rng(0)
    images = [rendered(t, *LAYOUTS[i], rng) for i, t in enumerate(PHRASES[:4])]
    write(root / "images", images, ["1.png", "2.jpg", "10.png", "11.jpg"])
    (root / "prompts.txt").write_text("".join(f'a sign that reads "{t}"\n' for t in PHRASES[:4]))
    (root / "swapped.txt").write_text("".join(f'a sign that reads "{PHRASES[i]}"\n' for i in (0, 2, 1, 3)))
    return root


def test_ocr_on_real_weights_readable_and_json(signs, capsys):
    pytest.importorskip("rapidocr_onnxruntime", reason="the ocr extra: rapidocr-onnxruntime (Python < 3.13)")
    args = ["score", "--term", "ocr", "--images", str(signs / "images"), "--set", "reward.terms.ocr.threads=1"]
    assert cli.main([*args, "--prompts", str(signs / "prompts.txt")]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].startswith("jointrl score: ocr (fn ocr) on 4 images of")
    rows = [line.split() for line in table[2:6]]
    assert [r[0] for r in rows] == ["1.png", "2.jpg", "10.png", "11.jpg"]
    assert 'a sign that reads "OPEN 24 HOURS"' in table[2] and min(float(r[1]) for r in rows) >= 0.9
    assert table[-1] == f"  mean {np.mean([float(r[1]) for r in rows]):.4f} over 4 images"
    assert cli.main([*args, "--prompts", str(signs / "swapped.txt"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["term"] == "ocr" and out["files"] == ["1.png", "2.jpg", "10.png", "11.jpg"]
    assert out["mean"] == pytest.approx(np.mean(out["scores"]))
    swapped = out["scores"]
    assert swapped[0] >= 0.9 and swapped[3] >= 0.9 and max(swapped[1:3]) <= 0.4  # pairing is by name order


def test_the_configs_term_or_a_builtins_defaults():
    config, term = term_config("prompts-tiny", ["reward.terms.clip_score.scale=clipscore"], "clip_score")
    assert term.options().model == "tiny:clip" and term.options().scale == "clipscore"  # the preset's term
    config, term = term_config("shapes", ["reward.terms.clip_score.batch_size=2"], "clip_score")
    assert term.fn == "clip_score" and term.options().model is None and term.options().batch_size == 2
    assert config.reward.weights["image"] == 1.0  # the config's own terms are left as they are


def test_scores_as_the_term_scores_its_images_in_batches_of_one_size(tmp_path, capsys, monkeypatch):
    """The config's term (prompts-tiny's geneval, tiny models) on images of two sizes in batches of
    two: the same scores and strict verdicts as the term called on each image alone."""
    lines = Path("configs/data/geneval-tiny-eval.jsonl").read_text().splitlines()[:5]
    (tmp_path / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    rng = np.random.default_rng(3)
    images = [rng.uniform(-1, 1, (3, side, side)).astype(np.float32) for side in (32, 32, 48, 48, 32)]
    write(tmp_path / "images", images, [f"{i}.png" for i in range(5)])
    built = []
    monkeypatch.setattr("tasks.rewards.term.build_scorer", lambda *a: built.append(build_scorer(*a)) or built[-1])
    args = ["score", "--config", "prompts-tiny", "--term", "geneval", "--prompts", str(tmp_path / "prompts.jsonl"),
            "--images", str(tmp_path / "images"), "--set", "reward.terms.geneval.batch_size=2", "--json"]
    assert cli.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    [scorer] = built
    assert scorer.options.batch_size == 2 and scorer.options.model == "tiny:owlv2"
    prompts = load_prompts(str(tmp_path / "prompts.jsonl"))
    alone = [from_uint8(read_image(tmp_path / "images" / f"{i}.png"))[None] for i in range(5)]
    np.testing.assert_allclose(out["scores"], [scorer(a, [p], [{}])[0] for a, p in zip(alone, prompts)], atol=1e-9)
    assert out["strict"] == [scorer.strict(a, [p], [{}])[0] for a, p in zip(alone, prompts)]
    assert len(set(out["scores"])) > 1


@pytest.mark.parametrize("case, says", [
    ("fewer prompts", r"holds 4 images \(PNG/JPEG\) and --prompts '.*three.txt' 3 prompts"),
    ("unreadable image", "/10.png' cannot be read as an image"),
    ("unknown option", "reward.terms.ocr: .*treads: Extra inputs are not permitted"),
    ("unknown term", "--term nope: not a reward term of --config shapes"),
    ("text term", "--term format: shapes_format scores the refiners' text"),
    ("clip term", "--term temporal_consistency: temporal_consistency scores clips, not images"),
    ("no prompts file", "--prompts: .*no/such.txt: no such file"),
    ("no folder", "--images '.*nowhere' is not a folder"),
])
def test_bad_input_exits_2_naming_it_before_any_model_loads(case, says, signs, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("tasks.rewards.term.build_scorer", lambda *a: pytest.fail("a model was loaded"))
    prompts, images, term, extra = str(signs / "prompts.txt"), signs / "images", "ocr", []
    if case == "fewer prompts":
        (tmp_path / "three.txt").write_text("".join(f'"{t}"\n' for t in PHRASES[:3]))
        prompts = str(tmp_path / "three.txt")
    elif case == "unreadable image":
        images = Path(shutil.copytree(images, tmp_path / "images"))
        (images / "10.png").write_bytes(b"not a PNG")
    elif case == "unknown option":
        extra = ["--set", "reward.terms.ocr.treads=1"]
    elif case == "clip term":
        term, extra = "temporal_consistency", ["--set", "reward.terms.temporal_consistency.model=tiny:clip"]
    elif case in ("unknown term", "text term"):
        term = {"unknown term": "nope", "text term": "format"}[case]
    elif case == "no prompts file":
        prompts = "no/such.txt"
    else:
        images = tmp_path / "nowhere"
    code = cli.main(["score", "--term", term, "--prompts", prompts, "--images", str(images), *extra])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert re.search(says, err), err
