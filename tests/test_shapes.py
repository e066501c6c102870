"""The shapes world: the detector on rendered ground truth, and the reward's named terms."""
import numpy as np
import pytest

from tasks.base import Refinement
from tasks import SHAPES_TERMS
from tasks.reward_guard import RewardSet
from tasks.rewards.base import Options
from tasks.rewards.shapes import ShapesFidelity, ShapesFormat, ShapesImage, ShapesStyle, format_term
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


def shapes_reward(owners: dict) -> RewardSet:
    """The shapes terms as a run scores them: each on the refinements of the refiners owning it."""
    classes = {"image": ShapesImage, "fidelity": ShapesFidelity, "style": ShapesStyle, "format": ShapesFormat}
    return RewardSet({t: cls(Options(), None) for t, cls in classes.items()}, owners, timeout_s=10)


def test_blank_image_scores_zero_and_terms_are_in_unit_interval():
    prompts = [make_prompt(c, np.random.default_rng(i)) for i, c in enumerate(CATEGORIES)]
    blank = -np.ones((len(prompts), 3, 32, 32), np.float32)
    noise = np.random.default_rng(0).uniform(-1, 1, blank.shape).astype(np.float32)
    refs = [{"refiner_0": Refinement("bright red circle", True)} for _ in prompts]
    for images in (blank, noise):
        terms, valid, _ = shapes_reward({"style": ["refiner_0"]})(images, prompts, refs)
        assert set(terms) == set(SHAPES_TERMS) and valid.all()
        assert all(((v >= 0) & (v <= 1)).all() for v in terms.values())
    assert shapes_reward({})(blank, prompts, refs)[0]["image"].max() == 0.0


def test_text_terms_are_computed_on_the_owners_tokens():
    prompt = P("a red circle", "single_object", [O("circle", "red")])
    refs = {"refiner_0": Refinement("red circle", True), "refiner_1": Refinement("sharp vivid bold", True)}
    owners = {"fidelity": ["refiner_0"], "style": ["refiner_1"]}
    image = -np.ones((1, 3, 32, 32), np.float32)

    def text_scores(refs, owners):
        terms, _, _ = shapes_reward(owners)(image, [prompt], [refs])
        return {t: float(v[0]) for t, v in terms.items() if t != "image"}
    s = text_scores(refs, owners)
    assert s["fidelity"] == 1.0 and s["style"] == 1.0
    assert text_scores(refs, {"fidelity": ["refiner_1"]})["fidelity"] == 0.0
    assert text_scores({}, owners) == {"fidelity": 0.0, "style": 0.0, "format": 0.0}
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


def test_composed_texts_are_cut_at_the_text_encoders_length_as_documented():
    """The shapes text encoder reads at most `experts.text_encoder.max_sequence_length` tokens
    (38: a full prompt and three refinements whole): with five refiners the composed text is cut
    at its end, the last refiners' words first, and the encoder sees exactly the cut text."""
    import torch

    from experts.frontend import ShapesFrontEnd
    from tasks.shapes import BOS, SEP, SHAPES_VOCABULARY, WORD_TO_ID
    from tests.conftest import make_config
    assert SHAPES_VOCABULARY.compose([4, 5], [[6, 7], [8, 9, 10]], 7) == (BOS, 4, 5, SEP, 6, 7, SEP)
    assert SHAPES_VOCABULARY.compose([4, 5], [[6, 7], [8, 9, 10]], None) == (BOS, 4, 5, SEP, 6, 7, SEP, 8, 9, 10)
    config = make_config("experts.n_refiners=5")
    length = config.experts.text_encoder.max_sequence_length
    assert length == 38 == make_config().text_len()  # the default three refiners are never cut
    frontend = ShapesFrontEnd(config, torch.device("cpu"))
    long_prompt = P("a large red circle left of a small blue square and the bright green triangle above",
                    "position", [O("circle", "red"), O("square", "blue")], "left")  # 16 words, the most
    short_prompt = P("two red circles", "counting", [O("circle", "red", 2)])
    words = ["bright", "sharp", "clean", "vivid", "bold", "plain"]
    refs = {f"refiner_{i}": Refinement(" ".join(words[i:] + words[:i]), True) for i in range(5)}
    full = frontend.condition([long_prompt, short_prompt], [refs, refs])
    assert full["text"].shape[1] == length and not full["text_pad"].any()  # 1 + 16 + 5 x 7 = 53 cut to 38
    # the long prompt leaves room for three refinements: refiners 3 and 4 are not read at all
    first_three = frontend.condition([long_prompt], [{e: r for e, r in refs.items() if e < "refiner_3"}])
    assert torch.equal(full["text"][:1], first_three["text"])
    # the short one (1 + 3 + 5 x 7 = 39): refiner_4's last word is the one cut
    ids = [WORD_TO_ID[w] for w in short_prompt.text.split()]
    segments = [[WORD_TO_ID[w] for w in refs[f"refiner_{i}"].words] for i in range(5)]
    cut = SHAPES_VOCABULARY.compose(ids, segments, length)
    assert len(cut) == length and cut[-5:] == tuple(segments[4][:5])
    encoded = frontend.encoder.encoder(torch.tensor([cut]))
    assert torch.equal(full["text"][1], encoded[0])
