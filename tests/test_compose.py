"""task.compose: what the generator's text encoder reads of a refined sample. append (the default):
the prompt, then each refinement; replace: the refinements alone, as PromptRL's code feeds its
generator the rewrite, and the prompt where no refiner wrote anything. The reward is scored
against the original prompt either way."""
from types import SimpleNamespace

import pytest
import torch

import driver.cli as cli
from experts.flow_family import FamilyFrontEnd
from experts.frontend import ShapesFrontEnd
from tasks.base import Refinement, TextPrompt
from tasks.shapes import BOS, SEP, SHAPES_VOCABULARY, WORD_TO_ID, ObjectClause, Prompt
from tests.conftest import make_config, run_training


def test_replace_composes_the_written_segments_alone_and_the_prompt_where_none_was_written():
    assert SHAPES_VOCABULARY.compose([4, 5], [[6, 7], [], [8]], None, replace=True) == (BOS, 6, 7, SEP, 8)
    assert SHAPES_VOCABULARY.compose([4, 5], [[], []], None, replace=True) == SHAPES_VOCABULARY.compose([4, 5], [[], []], None)  # as append
    assert SHAPES_VOCABULARY.compose([4, 5], [[6, 7], [], [8]], 4, replace=True) == (BOS, 6, 7, SEP)
    assert SHAPES_VOCABULARY.compose([4, 5], [[6, 7], [], [8]], None) == (BOS, 4, 5, SEP, 6, 7, SEP, SEP, 8)  # append: as before


def test_under_replace_the_shapes_encoder_reads_the_refinements_in_place_of_the_prompt():
    red = Prompt.make("a red circle", "single_object", [ObjectClause("circle", "red")])
    blue = Prompt.make("a blue square", "single_object", [ObjectClause("square", "blue")])
    refs = {"refiner_0": Refinement("red circle", True), "refiner_1": Refinement("bright", True),
            "refiner_2": Refinement("", True)}
    replace = ShapesFrontEnd(make_config("task.compose=replace"), torch.device("cpu"))
    append = ShapesFrontEnd(make_config(), torch.device("cpu"))
    by_replace = replace.condition([red, blue], [refs, refs])["text"]
    assert torch.equal(by_replace[0], by_replace[1])  # the prompt is not read where a refiner wrote
    by_append = append.condition([red, blue], [refs, refs])["text"]
    assert not torch.equal(by_append[0], by_append[1])
    prompt_alone = append.condition([red], [{}])["text"]
    assert torch.equal(replace.condition([red], [{}])["text"], prompt_alone)  # no refiner wrote: the prompt
    ids = (BOS, WORD_TO_ID["red"], WORD_TO_ID["circle"], SEP, WORD_TO_ID["bright"])
    assert torch.equal(by_replace[0, :len(ids)], replace.encoder.encoder(torch.tensor([ids]))[0])
    # counterfactual: without the refiners that wrote, the prompt again
    without = replace.condition([red], [{"refiner_0": refs["refiner_0"]}], drop="refiner_0")["text"]
    assert torch.equal(without, prompt_alone)


@pytest.mark.parametrize("compose, expected", [("append", "a red circle, red circle, bright"),
                                               ("replace", "red circle, bright")])
def test_a_diffusers_familys_text_under_each_compose(compose, expected):
    frontend = SimpleNamespace(config=make_config(f"task.compose={compose}"))
    refs = {"refiner_0": Refinement("red circle", True), "refiner_1": Refinement("bright", True),
            "refiner_2": Refinement("", True)}
    prompt = TextPrompt("a red circle")
    assert FamilyFrontEnd.compose(frontend, prompt, refs, None) == expected
    assert FamilyFrontEnd.compose(frontend, prompt, {}, None) == "a red circle"
    assert FamilyFrontEnd.compose(frontend, prompt, {"refiner_2": refs["refiner_2"]}, None) == "a red circle"


@pytest.mark.parametrize("sets, named", [(["task.compose=replace", "experts.generator_only=true"], "task.compose"),
                                         (["task.compose=prepend"], "task.compose")])
def test_a_compose_the_run_cannot_have_exits_2_naming_the_key(sets, named, capsys):
    assert cli.main(["train", "--config", "shapes-tiny", *[a for s in sets for a in ("--set", s)]]) == 2
    err = capsys.readouterr().err
    assert named in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_a_run_under_replace_trains_scored_against_the_original_prompt(tmp_path):
    """Two steps with counterfactual credit (its regenerations drop one refinement each): the image
    term is the detector's score of each image against the prompt the sample was drawn for."""
    config = make_config("task.compose=replace", "trainer.steps=2", "cluster.mode=inline",
                         "algorithm.credit=counterfactual", "experts.generator.owns=[image]", preset="shapes-tiny")
    rows, _, _ = run_training(config, tmp_path)
    assert [r["step"] for r in rows] == [0, 1]
    assert all(0 <= r["reward/image"] <= 1 and r["counterfactual/generations"] > 0 for r in rows)
