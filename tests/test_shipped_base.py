"""The pretrained base the `shapes` preset starts from (configs/bases/shapes/, as `jointrl pretrain
--config shapes --set pretrain.out_dir=configs/bases/shapes` writes it): its files are the ones its
manifests list, made for exactly the preset's settings; the preset's experts load them; it draws
the held-out single objects; a config it does not fit is refused naming the key; and the run a
newcomer makes first prints its progress and its pictures, and no line of Ray's."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import SettingError
from driver.bases import base_dir, refiner_dir
from driver.preflight import load_config
from tests.shipped_bases import check_shipped_base

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "configs" / "bases" / "shapes"


def test_the_shipped_base_is_its_manifests_files_made_for_the_preset_and_the_preset_loads_it():
    base, _ = check_shipped_base("shapes", SHIPPED, max_mib=4, rewriter=True)
    assert json.loads((base / "eval.json").read_text())["sets"]["held_out"]["unrefined"]["image/strict"]


def test_the_shipped_base_draws_the_held_out_single_objects():
    """Strict accuracy (every clause right, GenEval's measure) on the held-out prompts of one object,
    one ODE sample each, without refinement."""
    from driver.commands.evaluate import base_config, evaluate
    from experts.pipeline import RolloutPipeline
    from tasks.evaluation import eval_prompts
    config = base_config(load_config("shapes", ["experts.base=null"]), next(SHIPPED.glob("base-*")))
    pipeline = RolloutPipeline(config)
    held = eval_prompts(config, pipeline)["held_out"]
    single = [p for p in held if p.metadata["tag"] == "single_object"]
    assert len(single) == config.evaluation.per_category == 20
    pipeline.task.eval_sets = lambda: {"held_out": single}  # the other tags are not what is asked here
    strict = evaluate(config, pipeline)["held_out"]["unrefined"]["image/strict"]["single_object"]
    assert strict >= 0.6, strict


def test_a_config_the_base_does_not_fit_is_refused_naming_the_key(tmp_path):
    with pytest.raises(SettingError, match=r"experts\.base: .* experts\.generator\.model\.d_model 64 there, 32 here"):
        load_config("shapes", ["experts.generator.model.d_model=32"])
    with pytest.raises(SettingError, match=r"refiner_1: it was made with experts\.refiner_1\.model\.d_model"):
        load_config("shapes", ["experts.refiner_1.model.d_model=16"])
    random = load_config("shapes", ["experts.base=null"])
    assert random.experts.generator.init is None and all(r.init is None for r in random.experts.refiners)
    hotter = load_config("shapes", ["experts.refiner_0.temperature=0.7"])  # how it samples, not its weights
    assert hotter.experts.refiners[0].init == hotter.experts.refiners[1].init
    one = load_config("shapes", ["experts.refiner_0.init=null"])
    assert one.experts.refiners[0].init is None and one.experts.refiners[1].init and one.experts.generator.init
    damaged = tmp_path / "bases"
    shutil.copytree(SHIPPED, damaged)
    preset_refiner = Path(load_config("shapes").experts.refiners[0].init).parent.name
    for other in damaged.glob("refiner-*"):  # the shipped rewriter's start: another preset's refiner
        if other.name != preset_refiner:
            shutil.rmtree(other)
    older = damaged / preset_refiner  # made with a setting this version no longer asks for
    manifest = json.loads((older / "manifest.json").read_text())
    manifest["made_from"]["temperature"] = 1.0
    (older / "manifest.json").write_text(json.dumps(manifest))
    older.rename(older.with_name("refiner-older"))
    with pytest.raises(SettingError, match=r"refiner_0: it was made with temperature 1\.0 there, not a setting here"):
        load_config("shapes", [f"experts.base={damaged}"])
    older.with_name("refiner-older").rename(older)
    weights = next(damaged.glob("base-*")) / "generator.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")
    with pytest.raises(SettingError, match=r"experts\.generator\.init: .* \(its sha256 differs\)"):
        load_config("shapes", [f"experts.base={damaged}"])
    (next(damaged.glob("refiner-*")) / "manifest.json").write_text("{not json")  # the nearest is the one left
    with pytest.raises(SettingError, match=r"experts\.generator\.model\.d_model 64 there, 32 here"):
        load_config("shapes", [f"experts.base={damaged}", "experts.generator.model.d_model=32"])
    with pytest.raises(SettingError, match=r"holds no readable pretrained refiner \(for refiner_1\)"):
        load_config("shapes", [f"experts.base={damaged}", "experts.refiner_1.model.d_model=16"])
    with pytest.raises(SettingError, match=r"experts\.refiner_0\.init: its manifest .*manifest\.json' cannot be read"):
        load_config("shapes", [f"experts.base={damaged}"])


@pytest.mark.cluster  # it starts the command, or a Ray, in a process of its own
def test_the_first_run_shows_progress_and_pictures_and_no_line_of_rays(tmp_path):
    """`jointrl train --config shapes` as `make run` starts it (3 steps): its own local Ray, whose
    lines go to RUN_DIR/ray.log; the terminal has jointrl's lines only, ending with the two
    pictures to open first."""
    run = tmp_path / "first"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-m", "driver", "train", "--config", "shapes", "--run-dir", str(run),
                           "--set", "trainer.steps=3"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert all(line.startswith(("jointrl:", "step ", "  ")) for line in out.splitlines()), out
    assert "WARNING" not in out and "core_worker" not in out
    pictures = [Path(line.strip()) for line in out.splitlines()[-2:]]
    assert [p.name for p in pictures] == ["rewards.png", "samples.png"] and all(p.is_file() for p in pictures)
    assert "Started a local Ray instance" in (run / "ray.log").read_text()  # Ray's lines went there


@pytest.mark.parametrize("n", [1, 5])
def test_any_number_of_refiners_starts_from_the_shipped_base(n, tmp_path):
    """The shapes text encoder's length is fixed (longer texts are cut), so the base shipped for the
    preset's three refiners is the base of one or five: every expert starts from its files, and a
    couple of steps train."""
    from tests.conftest import run_training
    config = load_config("shapes", [f"experts.n_refiners={n}", "trainer.steps=2", "trainer.prompts_per_step=1",
                                    "algorithm.group_size=4", "algorithm.num_skip_refinement=1",
                                    "experts.generator.sample_steps=4", "cluster.mode=inline"])
    preset = load_config("shapes")
    base, refiner = base_dir(preset, SHIPPED), refiner_dir(preset, "refiner_0", SHIPPED)
    assert config.experts.generator.init == str(base / "generator.safetensors")
    assert config.experts.text_encoder.init == str(base / "text_encoder.safetensors")
    assert [r.init for r in config.experts.refiners] == [str(refiner / "refiner.safetensors")] * n
    rows, info, _ = run_training(config, tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1]
    assert sorted(info["experts"]) == sorted([*(f"refiner_{i}" for i in range(n)), "generator"])
    assert all(info["experts"][e]["version"] == 2 for e in info["experts"])


def test_the_rare_wording_base_is_made_for_its_setting_and_reads_the_rare_words_worse():
    """configs/bases/shapes-rare/ (`jointrl pretrain --config shapes --set task.rare_wording=0.5`): the
    base whose captions said a colour, shape, count or relation in its rare synonym 1% of the time.
    The setting's premise, in its eval.json: the same held-out prompts are drawn worse so worded."""
    shipped = ROOT / "configs" / "bases" / "shapes-rare"
    base, _ = check_shipped_base("shapes", shipped, max_mib=4,
                                 overrides=("task.rare_wording=0.5", f"experts.base={shipped}"), rewriter=True)
    sets = json.loads((base / "eval.json").read_text())["sets"]
    usual, rare = (sets[name]["unrefined"]["image/strict"]["overall"] for name in ("held_out", "rare_wording"))
    assert rare < usual - 0.1, (usual, rare)
