"""`jointrl sample` draws a prompt from a trained run and prints each refiner's refinement; a
prompt the models cannot read (empty, over-long, unknown words) is an error that names it, exit 2,
and nothing is written."""
import zlib
from pathlib import Path

import numpy as np
import pytest

from driver import cli
from tasks.shapes import MAX_PROMPT_WORDS
from tests.conftest import trained_inline


def read_png(path: Path) -> np.ndarray:
    """The pixels of an 8-bit RGB PNG as driver.images writes it (one IDAT, filter 0 rows)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    w, h = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    at = data.index(b"IDAT")
    raw = zlib.decompress(data[at + 4: at + 4 + int.from_bytes(data[at - 4:at], "big")])
    return np.frombuffer(raw, np.uint8).reshape(h, 1 + 3 * w)[:, 1:].reshape(h, w, 3)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return trained_inline(tmp_path_factory.mktemp("sampled") / "run", "shapes-tiny", steps=2)


def test_sample_writes_the_images_and_prints_each_refinement(trained, capsys):
    assert cli.main(["sample", str(trained), "--prompt", "A red circle", "-n", "3"]) == 0
    out = capsys.readouterr().out
    png = trained / "samples" / "a-red-circle-seed0.png"
    assert f"images: {png}" in out
    assert all(f"[{i}] refiner_0:" in out and "refiner_2:" in out for i in range(3))
    pixels = read_png(png)
    assert pixels.shape[0] > 100 and pixels.shape[1] > 3 * 100  # three enlarged 32 px tiles side by side
    assert pixels.std() > 5                                      # not blank


def test_the_same_seed_draws_the_same_images(trained, tmp_path):
    pngs = [tmp_path / f"{k}.png" for k in "abc"]
    for png, seed in zip(pngs, (0, 0, 1)):
        assert cli.main(["sample", str(trained), "--prompt", "two blue squares", "-n", "2",
                         "--seed", str(seed), "--out", str(png)]) == 0
    a, b, c = (read_png(p) for p in pngs)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


@pytest.mark.parametrize("prompt, named", [("", "got 0"), ("   ", "got 0"),
                                           (" ".join(["red"] * (MAX_PROMPT_WORDS + 1)), f"got {MAX_PROMPT_WORDS + 1}"),
                                           ("a pink unicorn", "['pink', 'unicorn']")])
def test_a_prompt_the_models_cannot_read_is_named(trained, capsys, prompt, named):
    before = sorted(p.name for p in trained.rglob("*"))
    assert cli.main(["sample", str(trained), "--prompt", prompt]) == 2
    err = capsys.readouterr().err
    assert f"--prompt {prompt!r}" in err and named in err and "Nothing was drawn" in err
    assert sorted(p.name for p in trained.rglob("*")) == before


def test_sample_from_a_missing_run_is_named(tmp_path, capsys):
    assert cli.main(["sample", str(tmp_path / "nowhere"), "--prompt", "a red circle"]) == 2
    assert "not a run directory" in capsys.readouterr().err
