"""The shapes world: the detector on rendered ground truth, and the reward's named terms."""
import numpy as np
import pytest

from tasks.base import Refinement
from tasks.reward import TERMS, format_term, shapes_reward, text_scores
from tasks.shapes import (CATEGORIES, ObjectClause, Prompt, encode_words, image_checks, make_prompt, render,
                          strict_correct)

O = ObjectClause


def P(text, cat, objects, rel=None):
    return Prompt.make(text, cat, objects, rel)


def test_detector_is_strictly_right_on_correct_renders_of_every_category():
    rng = np.random.default_rng(11)
    for cat in CATEGORIES:
        for i in range(40):
            prompt = make_prompt(cat, rng, terse=bool(i % 2))
            assert strict_correct(render(prompt, rng), prompt), (cat, prompt.text)


def test_degraded_renders_score_near_zero_in_every_category():
    rng = np.random.default_rng(5)
    for cat in CATEGORIES:
        prompt = make_prompt(cat, rng)
        assert np.mean(image_checks(render(prompt, rng, degraded=True), prompt)) < 0.1, cat


@pytest.mark.parametrize("asked, drawn", [
    (P("a red circle", "colors", [O("circle", "red")]), P("a blue circle", "colors", [O("circle", "blue")])),
    (P("a red circle", "single_object", [O("circle", "red")]),
     P("a red square", "single_object", [O("square", "red")])),
    (P("three red circles", "counting", [O("circle", "red", 3)]),
     P("two red circles", "counting", [O("circle", "red", 2)])),
    (P("a red circle right of a blue square", "position", [O("circle", "red"), O("square", "blue")], "right"),
     P("a red circle left of a blue square", "position", [O("circle", "red"), O("square", "blue")], "left")),
    (P("a red circle and a blue square", "two_objects", [O("circle", "red"), O("square", "blue")]),
     P("a red circle", "single_object", [O("circle", "red")])),
], ids=["colour", "shape", "count", "position", "missing_object"])
def test_detector_catches_each_kind_of_wrong_render(asked, drawn):
    rng = np.random.default_rng(0)
    for _ in range(10):
        assert not strict_correct(render(drawn, rng), asked)


def test_blank_image_scores_zero_and_terms_are_in_unit_interval():
    prompts = [make_prompt(c, np.random.default_rng(i)) for i, c in enumerate(CATEGORIES)]
    blank = -np.ones((len(prompts), 3, 32, 32), np.float32)
    noise = np.random.default_rng(0).uniform(-1, 1, blank.shape).astype(np.float32)
    refs = [{"refiner_0": Refinement("bright red circle", True)} for _ in prompts]
    for images in (blank, noise):
        terms = shapes_reward(images, prompts, refs, {"style": ["refiner_0"]})
        assert set(terms) == set(TERMS)
        assert all(((v >= 0) & (v <= 1)).all() for v in terms.values())
    assert shapes_reward(blank, prompts, refs, {})["image"].max() == 0.0


def test_text_terms_are_computed_on_the_owners_tokens():
    prompt = P("a red circle", "single_object", [O("circle", "red")])
    refs = {"refiner_0": Refinement("red circle", True), "refiner_1": Refinement("sharp vivid bold", True)}
    owners = {"fidelity": ["refiner_0"], "style": ["refiner_1"]}
    s = text_scores(prompt, refs, owners)
    assert s["fidelity"] == 1.0 and s["style"] == 1.0
    assert text_scores(prompt, refs, {"fidelity": ["refiner_1"]})["fidelity"] == 0.0
    assert text_scores(prompt, {}, owners) == {"fidelity": 0.0, "style": 0.0, "format": 0.0}
    assert format_term(Refinement("a a", False)) == pytest.approx(1 / 3)
    assert format_term(Refinement("red circle", True)) == 1.0


def test_bad_prompts_are_named():
    with pytest.raises(ValueError, match="unicorn"):
        encode_words(["a", "unicorn"])
    with pytest.raises(ValueError, match="1 to 16 words"):
        encode_words([])
    with pytest.raises(ValueError, match="1 to 16 words"):
        encode_words(["red"] * 17)


def test_paraphrase_keeps_the_clauses_in_other_words():
    from tasks.shapes import clause_key, eval_set, paraphrase, prompt_set
    train = prompt_set(48, seed=3)
    held = eval_set(5, seed=9, exclude=train)
    assert len(held) == 5 * len(CATEGORIES)
    assert not {clause_key(p) for p in held} & {clause_key(p) for p in train}
    rng = np.random.default_rng(1)
    for p in held:
        q = paraphrase(p)
        assert q.text != p.text and q.category == p.category
        assert strict_correct(render(p, rng), q) and strict_correct(render(q, rng), p)
