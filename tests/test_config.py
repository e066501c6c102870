"""Bad configs exit with status 2 and a message naming the key, before anything starts."""
import pytest
import yaml

from common.config import SettingError
import driver.cli as cli
from driver import presets
from driver.config import resolve_config
from driver.preflight import load_config


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
    # refiner 0 of 2 owns the text terms 0 and 2 (fidelity, format), whatever refiner_1 names
    assert cfg.experts.refiners[0].update_every == 3 and cfg.experts.refiners[0].owns == ["fidelity", "format"]
    assert cfg.algorithm.credit == "shared" and cfg.experts.generator.train is False
    assert cfg.cluster.mode == "inline"


def test_bad_yaml_file_is_named(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("experts: [unclosed")
    with pytest.raises(SettingError, match="broken.yaml"):
        load_config(str(path))


def test_existing_run_is_not_overwritten(no_training, tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    assert cli.main(["train", "--run-dir", str(tmp_path)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (tmp_path / "metrics.jsonl").read_text() == "{}\n"


def test_eval_of_a_missing_or_empty_run_exits_2(tmp_path, capsys):
    assert cli.main(["eval", str(tmp_path / "nope")]) == 2
    assert "not a run directory" in capsys.readouterr().err
    (tmp_path / "config.yaml").write_text("trainer: {steps: 1}\n")
    assert cli.main(["eval", str(tmp_path)]) == 2
    assert "no checkpoints" in capsys.readouterr().err


def _sections(model, where="Config"):
    """(where, model) of every config section below `model`: nested sections, list items, model kinds."""
    from driver.commands.config_docs import models_of
    yield where, model
    for name, field in model.model_fields.items():
        for section in models_of(field.annotation):
            yield from _sections(section, f"{where}.{name}")


def test_every_key_has_a_description():
    from driver.config import Config
    undocumented = [f"{where}.{name}" for where, model in _sections(Config)
                    for name, field in model.model_fields.items() if not (field.description or "").strip()]
    assert not undocumented


def test_config_keys_lists_every_key_with_its_type(capsys):
    assert cli.main(["config", "keys"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    for key in ("trainer.steps", "experts.generator.sde_window", "experts.refiner_<i>.lr", "cluster.max_staleness",
                "experts.generator.model.d_model", "experts.refiner_<i>.model.lora.r"):
        assert key in rows, key
    assert "int > 0" in rows["trainer.steps"] and "training steps" in rows["trainer.steps"]
    assert "[diffusers_flow]" in rows["experts.generator.model.guidance_scale"]


def test_config_show_prints_values_descriptions_and_defaults(capsys, tmp_path):
    assert cli.main(["config", "show", "--config", "shapes-tiny", "--set", "trainer.steps=7"]) == 0
    out = capsys.readouterr().out
    steps = next(line for line in out.splitlines() if line.strip().startswith("steps: 7"))
    assert "training steps" in steps and "(default 40)" in steps
    assert any(line.strip().startswith("n_train_prompts: 48  # ") and "default" not in line
               for line in out.splitlines())
    (tmp_path / "shown.yaml").write_text(out)  # what show prints loads back as the same config
    assert load_config(str(tmp_path / "shown.yaml")) == load_config("shapes-tiny", ["trainer.steps=7"])


def test_config_show_of_a_bad_key_exits_2_naming_it(capsys):
    assert cli.main(["config", "show", "--set", "bogus.key=1"]) == 2
    err = capsys.readouterr().err
    assert "bogus" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("name", presets.names())
def test_each_yaml_preset_loads_as_its_name(name):
    """(Without preflight: the one-GPU presets name prompt files of a Flow-GRPO clone.)"""
    from importlib.resources import files
    path = files("configs") / f"{name}.yaml"
    assert path.read_text().startswith("#")  # a header says what it is for
    assert resolve_config(str(path)).model_dump() == resolve_config(name).model_dump()


def test_unknown_config_lists_the_presets():
    with pytest.raises(SettingError, match="shapes-tiny") as e:
        load_config("no-such-preset")
    assert all(name in str(e.value) for name in ("shapes", "gpu", "shapes-cluster"))


def test_expert_ids_map_to_their_sections():
    cfg = load_config("shapes", ["experts.base=null", "experts.n_refiners=2", "experts.refiner_1.lr=0.01"])
    assert cfg.experts.ids() == ["refiner_0", "refiner_1", "generator"]
    assert cfg.expert("refiner_1").lr == 0.01 and cfg.expert("generator") is cfg.experts.generator
    assert cfg.owners() == {"fidelity": ["refiner_0"], "format": ["refiner_0"], "style": ["refiner_1"]}
    only = load_config("shapes", ["experts.generator_only=true"])
    assert only.experts.ids() == ["generator"] and only.expert("refiner_0") is only.experts.refiners[0]


def test_a_pipeline_of_an_unsupported_family_exits_2_naming_what_it_found(no_training, tmp_path, capsys):
    folder = tmp_path / "sdxl"
    folder.mkdir()
    (folder / "model_index.json").write_text('{"_class_name": "StableDiffusionXLPipeline"}')
    args = ["--set", f"experts.generator.model={{kind: diffusers_flow, path: {folder}}}"]
    assert cli.main(["train", *args, "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "experts.generator.model.path" in err and "StableDiffusionXLPipeline" in err
    assert all(family in err for family in ("StableDiffusion3Pipeline", "FluxPipeline", "Flux2KleinPipeline",
                                            "QwenImagePipeline"))


def test_refiner_defaults_apply_to_every_refiner_unless_its_own_section_sets_the_key():
    """`experts.refiner_defaults.<key>` is every refiner's, key by key at any depth, unless the
    refiner's own section names the key; a list, a mapping or null replaces the default's whole, and
    a model of another kind replaces its model."""
    hf = "{kind: hf_causal_lm, path: 'tiny:qwen2', lora: {r: 4, alpha: 8}}"
    cfg = resolve_config("shapes", ["experts.base=null", "experts.refiner_defaults.kl_beta=0.1",
                                    "experts.refiner_1.kl_beta=0.2", f"experts.refiner_defaults.model={hf}",
                                    "experts.refiner_0.model.lora.alpha=2", "experts.refiner_1.model.lora=null",
                                    "experts.refiner_2.model={kind: tiny_lm, d_model: 32}",
                                    "experts.refiner_defaults.resources.custom={pool: 1}",
                                    "experts.refiner_2.resources.custom={other: 2}",
                                    "experts.refiner_defaults.resources.num_cpus=0.5",
                                    "experts.refiner_defaults.owns=[style]", "experts.refiner_0.owns=[format]"])
    r0, r1, r2 = cfg.experts.refiners
    assert [r.kl_beta for r in (r0, r1, r2)] == [0.1, 0.2, 0.1]
    assert (r0.model.kind, r0.model.path, r0.model.lora.r, r0.model.lora.alpha) == ("hf_causal_lm", "tiny:qwen2", 4, 2)
    assert (r1.model.kind, r1.model.path, r1.model.lora) == ("hf_causal_lm", "tiny:qwen2", None)
    assert (r2.model.kind, r2.model.d_model) == ("tiny_lm", 32)
    assert [r.resources.custom for r in (r0, r1, r2)] == [{"pool": 1}, {"pool": 1}, {"other": 2}]
    assert [r.resources.num_cpus for r in (r0, r1, r2)] == [0.5] * 3
    assert [r.owns for r in (r0, r1, r2)] == [["format"], ["style"], ["style"]]
    more = resolve_config("shapes", ["experts.base=null", "experts.n_refiners=5", "experts.refiner_defaults.lr=0.01"])
    assert [r.lr for r in more.experts.refiners] == [0.01] * 5


def test_config_keys_and_show_have_the_refiner_defaults(capsys, tmp_path):
    assert cli.main(["config", "keys"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "experts.refiner_defaults.model.lora.r" in rows and "at any depth" in rows["experts.refiner_defaults"]
    assert cli.main(["config", "show", "--config", "prompts-tiny", "--set", "experts.refiner_defaults.lr=0.01"]) == 0
    out = capsys.readouterr().out
    assert "  refiner_defaults:  # keys every refiner takes" in out
    (tmp_path / "shown.yaml").write_text(out)  # loads back as the same config
    assert resolve_config(str(tmp_path / "shown.yaml")) == resolve_config("prompts-tiny", ["experts.refiner_defaults.lr=0.01"])


@pytest.mark.parametrize("name", presets.names())
def test_every_preset_takes_any_number_of_refiners(name):
    """A preset's refiners share `refiner_defaults`: `--set experts.n_refiners=K` keeps its first K
    sections and gives the others the defaults, not the schema's; owns goes round robin over the
    text terms, so every text term has an owner."""
    base = resolve_config(name)
    text = [t for t, term in base.reward.terms.items() if not term.needs_images()]
    for k in (1, 2, 3, 5):
        cfg = resolve_config(name, [f"experts.n_refiners={k}"])
        assert len(cfg.experts.refiners) == k
        for i, r in enumerate(cfg.experts.refiners):
            model = base.experts.refiners[min(i, base.experts.n_refiners - 1)].model
            assert (r.model.kind, getattr(r.model, "path", None)) == (model.kind, getattr(model, "path", None))
            assert (r.lr, r.max_new_tokens, r.resources) == (base.experts.refiners[0].lr,
                                                               base.experts.refiners[0].max_new_tokens,
                                                               base.experts.refiners[0].resources)
        explicit = name == "prompts-tiny"  # its refiners own terms of their own choosing
        if not explicit:
            assert set(cfg.owners()) == set(text)
    with pytest.raises(SettingError, match="refiner_1 is configured but n_refiners=1"):
        resolve_config(name, ["experts.n_refiners=1", "experts.refiner_1.lr=0.1"])  # a --set section beyond K


def test_owns_names_no_term_under_shared_credit_without_refusal():
    """Shared credit credits every expert with the total: refiners' `owns` naming terms that are not
    there are let go (the refiner then owns as if unset), not refused as under per_expert."""
    ocr = "reward.terms={ocr: {fn: ocr, weight: 1}}"
    shared = resolve_config("prompts-tiny", [ocr, "algorithm.credit=shared"])  # refiner_0 owns [format] there
    assert [r.owns for r in shared.experts.refiners] == [["ocr"], ["ocr"]]
    with pytest.raises(SettingError, match=r"experts\.refiner_0\.owns names \['format'\], not a reward term"):
        resolve_config("prompts-tiny", [ocr, "algorithm.credit=per_expert"])
    kept = resolve_config("prompts-tiny", ["algorithm.credit=shared", "experts.refiner_1.owns=[faithful, nothing]"])
    assert kept.experts.refiners[1].owns == ["faithful"]


def test_every_command_that_reads_a_run_takes_it_as_run_dir_and_the_older_run_flag_with_a_note(tmp_path, capsys):
    """eval, sample and report read a run as RUN_DIR; `--run RUN_DIR` (eval's and sample's earlier
    form) still works for one release, with a one-line note; both, or neither, is exit 2."""
    nope = str(tmp_path / "nope")
    assert cli.main(["report", nope]) == 2 and "no metrics there" in capsys.readouterr().err
    for command, *rest in (["eval"], ["sample", "--prompt", "a red circle"]):
        assert cli.main([command, nope, *rest]) == 2
        assert capsys.readouterr().err.splitlines() == [f"jointrl: RUN_DIR '{nope}' is not a run directory (no "
                                                        f"config.yaml there)"]
        assert cli.main([command, "--run", nope, *rest]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"jointrl: note: `jointrl {command} --run RUN_DIR` is now `jointrl {command} RUN_DIR`; --run goes in "
            f"the next release", f"jointrl: RUN_DIR '{nope}' is not a run directory (no config.yaml there)"]
        for wrong in ([command, nope, "--run", nope], [command]):
            with pytest.raises(SystemExit) as ended:
                cli.main([*wrong, *rest])
            assert ended.value.code == 2 and "RUN_DIR" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["eval", nope, "--base", nope])
