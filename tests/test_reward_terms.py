"""Reward terms as a run composes them: the text terms on cases computed by hand, every term of a
batch scored at once on the refinements of its owners, a failing term costing only its samples,
term options checked with the config, and prompts drawn epoch by epoch."""
import logging
import threading
import time

import numpy as np
import pytest
import torch

from algorithm.batch import step_prompts
from common.config import SettingError
from driver.config import ClusterConfig, resolve_config
from driver.preflight import load_config
from tasks.base import Refinement, TextPrompt
from tasks.reward_guard import FailingRewards, RewardSet
from tasks.rewards.term import TermConfig, build_scorer
from tasks.rewards.text import Faithful, FaithfulOptions, Format, FormatOptions, Length, LengthOptions

GENEVAL = TextPrompt("a photo of two dogs and a red car", {"tag": "counting", "include": [
    {"class": "dog", "count": 2}, {"class": "car", "count": 1, "color": "red"}]})


def ref(text, ended=True, formatted=None):
    return {"refiner_0": Refinement(text, ended, formatted)}


def test_format_length_and_faithful_by_hand():
    fmt = Format(FormatOptions(), None)
    refs = [ref("a dog", True, True), ref("a dog", False, True), ref("a dog", True, False), ref("", True, None), {}]
    np.testing.assert_array_equal(fmt(None, [GENEVAL] * 5, refs), [1, 0, 0, 0, 0])
    length = Length(LengthOptions(budget=4), None)
    texts = ["one two", "one two three four", "1 2 3 4 5 6", "1 2 3 4 5 6 7 8 9", ""]
    np.testing.assert_allclose(length(None, [GENEVAL] * 5, [ref(t) for t in texts]), [1, 1, 0.5, 0, 0])
    faithful = Faithful(FaithfulOptions(), None)
    said = ["two fluffy dogs beside a red car", "2 dogs, a blue car", "a cat", "dogs car"]
    # clauses: dog named, count 2 said, car named, red said
    np.testing.assert_allclose(faithful(None, [GENEVAL] * 4, [ref(t) for t in said]), [1, 0.75, 0, 0.5])
    plain = TextPrompt("A storefront sign that reads \"OPEN 24 HOURS\"")
    # content words: storefront, sign, reads, open, 24, hours
    np.testing.assert_allclose(faithful(None, [plain], [ref("a sign reading open 24 hours")]), [4 / 6])


def test_faithful_with_a_text_model_is_the_cosine_of_its_embeddings():
    from transformers import AutoTokenizer, CLIPModel

    from common.hub import local_model
    faithful = Faithful(FaithfulOptions(model="tiny:clip"), torch.device("cpu"))
    prompts = [TextPrompt("a quiet lake at dawn"), TextPrompt("a red bicycle"), GENEVAL]
    refs = [ref("a calm lake, sunrise, mist"), ref("bicycle"), ref("two dogs")]
    got = faithful(None, prompts, refs)
    path = local_model("tiny:clip")
    tokenizer, model = AutoTokenizer.from_pretrained(path), CLIPModel.from_pretrained(path)
    with torch.no_grad():
        for i in range(2):
            feats = model.get_text_features(**tokenizer([prompts[i].text, refs[i]["refiner_0"].text], padding=True,
                                                        return_tensors="pt"))
            feats = feats if isinstance(feats, torch.Tensor) else feats.pooler_output
            feats = torch.nn.functional.normalize(feats, dim=-1)
            assert got[i] == pytest.approx(float((feats[0] @ feats[1]).clamp(0, 1)), abs=1e-5)
    assert got[2] == 0.5  # a GenEval prompt is scored by its clauses: dog and its count


def test_every_term_of_a_batch_is_scored_at_once_on_its_owners_refinements():
    both = threading.Barrier(2, timeout=10)  # neither term returns unless the other runs meanwhile
    seen = {}

    def term(name):
        def score(images, prompts, refinements):
            both.wait()
            seen[name] = [sorted(r) for r in refinements]
            return np.ones(len(prompts))
        return score
    rewards = RewardSet({"a": term("a"), "b": term("b")}, {"a": ["refiner_1"]}, timeout_s=20)
    refinements = [{"refiner_0": Refinement("x", True), "refiner_1": Refinement("y", True)}, {}]
    terms, valid, faults = rewards(np.zeros((2, 3, 4, 4)), [GENEVAL] * 2, refinements)
    assert valid.all() and not any(faults.counts.values())
    assert seen == {"a": [["refiner_1"], []], "b": [["refiner_0", "refiner_1"], []]}


def test_a_failing_term_costs_its_samples_only_and_says_why(caplog):
    def picky(images, prompts, refinements):
        if any("cat" in p.text for p in prompts):
            raise RuntimeError("no cats here")
        return np.full(len(prompts), 0.5)
    prompts = [TextPrompt("a dog"), TextPrompt("a cat"), TextPrompt("a cow")]
    rewards = RewardSet({"picky": picky, "fine": lambda i, p, r: np.arange(len(p), dtype=float)}, {}, timeout_s=5)
    with caplog.at_level(logging.WARNING, logger="jointrl.reward"):
        terms, valid, faults = rewards(np.zeros((3, 3, 4, 4)), prompts, [{}, {}, {}])
    assert valid.tolist() == [True, False, True] and faults.counts["reward_error"] == 1
    np.testing.assert_array_equal(terms["fine"], [0, 0, 2])  # an invalid sample's terms are 0
    assert "picky" in caplog.text and "no cats here" in caplog.text
    assert (faults.terms["picky"].scored, faults.terms["picky"].failed) == (3, 1) and faults.terms["fine"].failed == 0
    assert faults.failing() == "reward.terms.picky failed on 1 of 3 samples (last error: RuntimeError: no cats here)"


def test_steps_whose_every_sample_failed_are_counted_in_a_row_with_what_failed():
    """Only a step in which no sample's reward could be had counts; one valid sample starts the
    count again. What the stop says: each failing term, its failed samples of those scored over
    the failed steps, and its last error (a raise, a non-finite score)."""
    def broken(images, prompts, refinements):
        raise OSError(f"model gone ({len(prompts)})")
    nan = RewardSet({"nan": lambda i, p, r: np.full(len(p), np.nan)}, {}, timeout_s=5)
    rewards = {"ok": RewardSet({"a": lambda i, p, r: np.ones(len(p))}, {}, timeout_s=5),
               "broken": RewardSet({"broken": broken, "fine": lambda i, p, r: np.ones(len(p))}, {}, timeout_s=5)}
    failing = FailingRewards(limit=2)
    prompts = [TextPrompt("a dog")] * 3
    for which, stop in (("broken", False), ("ok", False), ("broken", False), ("broken", True)):
        _, valid, faults = rewards[which](np.zeros((3, 3, 4, 4)), prompts, [{}] * 3)
        failing.observe(valid, faults)
        assert failing.stop == stop
    assert str(failing) == ("the reward failed on every sample of 2 steps in a row (reward.max_failed_steps=2), so "
                            "nothing could be learnt: reward.terms.broken failed on 6 of 6 samples (last error: "
                            "OSError: model gone (1))")
    never = FailingRewards(limit=0)
    for _ in range(5):
        _, valid, faults = nan(np.zeros((2, 3, 4, 4)), prompts[:2], [{}] * 2)
        never.observe(valid, faults)
    assert not never.stop and never.steps == 5 and faults.counts["reward_nan"] == 2
    assert "reward.terms.nan failed on 10 of 10 samples (last error: scored nan (not a finite number))" in str(never)


def test_a_term_that_returns_a_dict_is_an_error_naming_it():
    rewards = RewardSet({"old": lambda i, p, r: {"old": np.ones(len(p))}}, {}, timeout_s=5)
    _, valid, faults = rewards(np.zeros((1, 3, 4, 4)), [GENEVAL], [{}])
    assert not valid.any() and faults.counts["reward_error"] == 1


@pytest.mark.parametrize("term, says", [
    ({"fn": "geneval", "threshhold": 0.3}, "threshhold"),
    ({"fn": "length", "budget": 0}, "budget"),
    ({"fn": "tasks.scorers:sharpness", "model": "x"}, "takes no options"),
    ({"fn": "no_such_builtin"}, "package.module:function"),
])
def test_term_options_are_checked_with_the_config(term, says):
    """A built-in's by the schema, a plug-in's by preflight: a config error naming the term either way."""
    with pytest.raises(SettingError, match=says) as e:
        load_config("shapes", [f"reward.terms={{t: {term}}}".replace("'", ""), "experts.generator.owns=null"])
    assert "reward.terms.t" in str(e.value)


def test_dotted_term_keys_change_a_term_and_keep_the_others_a_mapping_replaces_them():
    kept = resolve_config("shapes", ["reward.terms.style.weight=0"])
    assert kept.reward.weights == {"image": 1.0, "fidelity": 0.5, "style": 0.0, "format": 0.5}
    replaced = resolve_config("shapes", ["reward.terms={image: {fn: shapes_image}, f: {fn: format}}"])
    assert replaced.experts.generator.owns == ["image"]  # the preset's
    assert replaced.reward.weights == {"image": 1.0, "f": 1.0}
    assert [r.owns for r in replaced.experts.refiners] == [["f"]] * 3  # the only text term
    image_only = resolve_config("shapes", ["reward.terms={image: {fn: shapes_image}}", "algorithm.credit=shared"])
    assert [r.owns for r in image_only.experts.refiners] == [["image"]] * 3  # no text term: the total
    assert build_scorer(TermConfig(fn="format"), None).__class__ is Format


def test_config_keys_list_every_builtins_options():
    from driver.commands.config_docs import keys
    listed = keys()
    for key in ("reward.terms.<name>.fn", "reward.terms.<name>.weight", "reward.terms.<name>.detector",
                "reward.terms.<name>.budget", "reward.terms.<name>.question", "reward.terms.<name>.unquoted"):
        assert key in listed, key


def test_prompts_are_drawn_epoch_by_epoch():
    n, per_step = 10, 3
    drawn = [i for step in range(10) for i in step_prompts(n, step, seed=7, prompts_per_step=per_step)]
    for epoch in range(3):
        assert sorted(drawn[epoch * n:(epoch + 1) * n]) == list(range(n))  # each prompt once per epoch
    assert drawn[:n] != list(range(n)) and drawn[:n] != drawn[n:2 * n]   # shuffled, anew each epoch
    assert step_prompts(n, 5, 7, per_step) == drawn[15:18]                # a step's prompts need no history


def test_preflight_names_the_readers_package_and_missing_model_files(monkeypatch):
    """The packages checked are those the term's options import (the ocr extra for PP-OCRv4, hf for
    TrOCR), and an ONNX file named by an option must exist: a config error naming the key."""
    import importlib.util

    from driver import preflight
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "rapidocr_onnxruntime" else find_spec(name, *a))
    assert preflight.term_problems("reward.terms.ocr", TermConfig(fn="ocr")) == [
        "reward.terms.ocr.fn: ocr needs ['rapidocr_onnxruntime']: pip install 'jointrl[ocr]'"]
    assert preflight.term_problems("reward.terms.ocr", TermConfig(fn="ocr", reader="trocr", model="tiny:trocr")) == []
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert preflight.term_problems("reward.terms.ocr", TermConfig(fn="ocr", rec_model="no/such/rec.onnx")) == [
        "reward.terms.ocr.rec_model: no file at 'no/such/rec.onnx'"]


def test_the_deadline_grows_with_the_batch():
    """A call of n images may take timeout_s + n x timeout_per_image_s: a slow model's whole batch
    is scored in one call, where one fixed deadline would have timed it out and scored it again
    sample by sample; a sample that hangs still costs only itself."""
    calls = []

    def per_image(images, prompts, refinements):  # 0.05 s an image, 1.5 s for a cat
        calls.append(len(prompts))
        time.sleep(1.5 if any("cat" in p.text for p in prompts) else 0.05 * len(prompts))
        return np.ones(len(prompts))
    batch = [TextPrompt("a dog")] * 12
    for per_image_s, expected in ((0.1, [12]), (0.0, [12] + [1] * 12)):
        calls.clear()
        rewards = RewardSet({"slow": per_image}, {}, timeout_s=0.3, timeout_per_image_s=per_image_s)
        assert rewards.seconds(12) == pytest.approx(0.3 + 12 * per_image_s)
        _, valid, faults = rewards(np.zeros((12, 3, 4, 4)), batch, [{}] * 12)
        assert valid.all() and not any(faults.counts.values()) and calls == expected
    rewards = RewardSet({"slow": per_image}, {}, timeout_s=0.3, timeout_per_image_s=0.1)
    _, valid, faults = rewards(np.zeros((3, 3, 4, 4)), [TextPrompt("a dog"), TextPrompt("a cat"), TextPrompt("a cow")],
                               [{}] * 3)
    assert valid.tolist() == [True, False, True] and faults.counts["reward_timeout"] == 1


class Scorer:
    """A reward actor in-process: scores each sample by its position in the batch, records its calls."""

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def score(self, images, prompts, refinements):
        self.calls.append((self.name, [p.text for p in prompts]))
        return np.array([float(p.text) for p in prompts])

    def ready(self):
        return 0


def test_a_pooled_term_sends_its_batch_in_calls_of_images_per_call_to_the_actors_in_turn():
    from cluster.reward_pool import PooledTerm
    from cluster.runtime import InlineHandle
    calls = []
    term = PooledTerm([InlineHandle(Scorer(k, calls)) for k in "ab"], first=1, restarts=ClusterConfig(max_restarts=0),
                      images_per_call=3)
    prompts = [TextPrompt(str(i)) for i in range(7)]
    np.testing.assert_array_equal(term(np.zeros((7, 3, 4, 4)), prompts, [{}] * 7), np.arange(7.0))
    assert calls == [("b", ["0", "1", "2"]), ("a", ["3", "4", "5"]), ("b", ["6"])]
    calls.clear()
    whole = PooledTerm([InlineHandle(Scorer("a", calls))], first=0,
                       restarts=ClusterConfig(max_restarts=0))  # the whole batch in one call
    whole(np.zeros((7, 3, 4, 4)), prompts, [{}] * 7)
    assert calls == [("a", [p.text for p in prompts])]


def test_images_per_call_is_a_key_of_a_term_with_reward_actors_and_answers_leave_them_on_the_host():
    import torch

    from cluster.reward_pool import on_host
    config = load_config("shapes", ["reward.terms.image.actors=2", "reward.terms.image.images_per_call=8"])
    assert config.reward.terms["image"].images_per_call == 8 and config.reward.pools()["image"][0] == 2
    with pytest.raises(SettingError, match=r"reward.terms.fidelity.images_per_call=8: the term is scored by each "
                                          r"rollout worker"):
        load_config("shapes", ["reward.terms.fidelity.images_per_call=8"])
    out = on_host(torch.tensor([0.5, 1.0], dtype=torch.float64))
    assert isinstance(out, np.ndarray) and out.tolist() == [0.5, 1.0]
