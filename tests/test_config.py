"""Bad configs exit with status 2 and a message naming the key, before anything starts."""
import pytest
import yaml

import driver.cli as cli
from driver.config import ConfigError, load_config


@pytest.fixture
def no_training(monkeypatch):
    def refuse(*_):
        raise AssertionError("training started for a bad config")
    monkeypatch.setattr(cli, "train", refuse)


@pytest.mark.parametrize("args, named", [
    (["--set", "experts.n_refiners=0"], "experts.n_refiners"),
    (["--set", "algorithm.credit=bogus"], "algorithm.credit"),
    (["--set", "algorithm.num_skip_refinement=8"], "num_skip_refinement"),
    (["--set", "algorithm.group_size=4", "--set", "algorithm.num_skip_refinement=5"], "num_skip_refinement"),
    (["--set", "experts.refiner_1.lr=-0.001"], "experts.refiners.1.lr"),
    (["--set", "experts.generator.lr=-1"], "experts.generator.lr"),
    (["--config", "no-such-preset"], "no-such-preset"),
    (["--set", "trainer.steps=many"], "trainer.steps"),
    (["--set", "cluster.rollout_workers=1.5"], "cluster.rollout_workers"),
    (["--set", "experts.generator.train=maybe"], "experts.generator.train"),
    (["--set", "trainer.stepz=3"], "trainer.stepz"),
    (["--set", "experts.refiner_5.lr=0.1"], "refiner_5"),
    (["--set", "experts.refiner_0.owns=[sparkle]"], "experts.refiner_0.owns"),
    (["--set", "trainer.steps"], "trainer.steps"),
    (["--set", "experts.generator.init=/no/such/generator.pt"], "init"),
    (["--set", "experts.generator.owns=[glitter]"], "experts.generator.owns"),
    (["--set", "experts.generator_only=true", "--set", "experts.generator.train=false"], "generator_only"),
])
def test_bad_config_exits_2_naming_the_key(args, named, no_training, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert cli.main(["train", *args, "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert named in err and err.count("\n") == 1, err
    assert not run_dir.exists()


def test_yaml_config_and_overrides_resolve(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"experts": {"n_refiners": 2, "refiner_1": {"lr": 0.01, "owns": ["format"]}},
                                    "trainer": {"steps": 7}}))
    cfg = load_config(str(path), ["experts.refiner_0.update_every=3", "algorithm.credit=shared",
                                  "experts.generator.train=false", "cluster.mode=inline"])
    assert cfg.experts.n_refiners == 2 and cfg.trainer.steps == 7
    assert cfg.experts.refiners[1].lr == 0.01 and cfg.experts.refiners[1].owns == ["format"]
    assert cfg.experts.refiners[0].update_every == 3 and cfg.experts.refiners[0].owns == ["fidelity"]
    assert cfg.algorithm.credit == "shared" and cfg.experts.generator.train is False
    assert cfg.cluster.mode == "inline"


def test_bad_yaml_file_is_named(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("experts: [unclosed")
    with pytest.raises(ConfigError, match="broken.yaml"):
        load_config(str(path))


def test_existing_run_is_not_overwritten(no_training, tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    assert cli.main(["train", "--run-dir", str(tmp_path)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (tmp_path / "metrics.jsonl").read_text() == "{}\n"


def test_eval_of_a_missing_or_empty_run_exits_2(tmp_path, capsys):
    assert cli.main(["eval", "--run", str(tmp_path / "nope")]) == 2
    assert "not a run directory" in capsys.readouterr().err
    (tmp_path / "config.yaml").write_text("trainer: {steps: 1}\n")
    assert cli.main(["eval", "--run", str(tmp_path)]) == 2
    assert "no checkpoints" in capsys.readouterr().err
