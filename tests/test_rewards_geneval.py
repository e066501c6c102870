"""The `geneval` reward: GenEval's clause logic on hand-made detections (no model), both partial
credits and the strict score against transcriptions of GenEval's `evaluate` and Flow-GRPO's
`evaluate_reward` on thousands of random detection sets, then the real loading, batching and
post-processing code on tiny random OWLv2 / Grounding DINO and CLIP models."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tasks.prompt_data import DataPrompt
from tasks.rewards.base import RewardModel
from tasks.rewards.detectors import Detection, grounding_detections, owl_detections, ranked, select
from tasks.rewards.geneval import (GenEval, GenEvalOptions, checked, clauses, flow_grpo_credit, relative_position,
                                  to_colour)

# one prompt per tag, as in GenEval's prompts/evaluation_metadata.jsonl (github djghosh13/geneval at af4902f)
GENEVAL = {
    "single_object": {"tag": "single_object", "include": [{"class": "bench", "count": 1}]},
    "two_object": {"tag": "two_object", "include": [{"class": "bench", "count": 1},
                                                    {"class": "sports ball", "count": 1}]},
    "counting": {"tag": "counting", "include": [{"class": "clock", "count": 2}],
                 "exclude": [{"class": "clock", "count": 3}]},
    "colors": {"tag": "colors", "include": [{"class": "fire hydrant", "count": 1, "color": "blue"}]},
    "position": {"tag": "position", "include": [{"class": "teddy bear", "count": 1},
                                                {"class": "dog", "count": 1, "position": ["right of", 0]}]},
    "color_attr": {"tag": "color_attr", "include": [{"class": "wine glass", "count": 1, "color": "purple"},
                                                    {"class": "apple", "count": 1, "color": "black"}]},
}
CPU = torch.device("cpu")


def det(label: str, x0: float, y0: float = 0.0, size: float = 10.0, score: float = 0.9) -> Detection:
    return Detection(label, score, (x0, y0, x0 + size, y0 + size))


def no_colour(d: Detection) -> str:
    raise AssertionError(f"colour asked of {d}")


# --- the clauses, by hand ------------------------------------------------------------------------- #

def test_counts_at_least_in_include_and_exactly_with_the_exclude():
    clocks = [det("clock", 20 * i, score=0.9 - 0.1 * i) for i in range(3)]
    m = GENEVAL["counting"]
    assert clauses(m, clocks[:2], no_colour) == [True, True]    # exact
    assert clauses(m, clocks[:1], no_colour) == [False, True]   # too few
    assert clauses(m, clocks, no_colour) == [True, False]       # too many: the exclude clause fails
    assert clauses(m, [], no_colour) == [False, True]
    assert clauses(m, clocks[:2] + [det("bench", 0)], no_colour) == [True, True]  # other classes do not count


def test_colour_is_checked_on_the_most_confident_objects_only():
    m = {"include": [{"class": "cup", "count": 2, "color": "red"}]}
    best, second, third = det("cup", 0, score=0.9), det("cup", 20, score=0.8), det("cup", 40, score=0.7)
    colours = {best: "red", second: "red", third: "blue"}
    assert to_colour(m, [third, best, second]) == [best, second]
    assert clauses(m, [third, best, second], colours.__getitem__) == [True, True]
    colours[second] = "green"
    assert clauses(m, [third, best, second], colours.__getitem__) == [True, False]
    assert clauses(m, [best], no_colour) == [False, False]  # too few: no colour asked, the clause fails
    assert to_colour(m, [best]) == [best]


@pytest.mark.parametrize("relation, dog", [("right of", (30, 0)), ("left of", (-30, 0)),
                                           ("above", (0, -30)), ("below", (0, 30))])
def test_each_relation(relation, dog):
    m = {"include": [{"class": "teddy bear", "count": 1},
                     {"class": "dog", "count": 1, "position": [relation, 0]}]}
    bear, near, far = det("teddy bear", 0), det("dog", *dog), det("dog", -dog[0], -dog[1])
    assert clauses(m, [bear, near], no_colour) == [True, True, True]
    assert clauses(m, [bear, far], no_colour) == [True, True, False]
    assert clauses(m, [near], no_colour) == [False, True, False]  # no target: the position fails
    assert relative_position(near.box, bear.box, 0.1) == {relation}


def test_the_position_margin_boundary():
    """Boxes of side 10, `b` x to the right: the offset shrinks by 0.1 * (10 + 10) = 2, and a
    relation needs the shrunk offset beyond half the full one, (x - 2) / x > 0.5, so x > 4."""
    a = (0.0, 0.0, 10.0, 10.0)
    shifted = lambda x: (x, 0.0, x + 10.0, 10.0)
    assert relative_position(a, shifted(2.0), 0.1) == set()         # within the margin: no relation at all
    assert relative_position(a, shifted(4.0), 0.1) == set()         # exactly half: not yet
    assert relative_position(a, shifted(4.5), 0.1) == {"left of"}
    assert relative_position(a, shifted(4.0), 0.0) == {"left of"}  # no margin
    assert relative_position(shifted(4.5), a, 0.1) == {"right of"}
    assert relative_position(a, (4.5, 4.5, 14.5, 14.5), 0.1) == set()  # diagonal: 45 degrees is neither
    assert relative_position(a, (20.0, 20.0, 30.0, 30.0), 0.1) == {"left of", "above"}  # 45 degrees, far: both


def test_position_needs_the_target_clause_to_hold_entirely():
    m = {"include": [{"class": "cat", "count": 1, "color": "black"},
                     {"class": "dog", "count": 1, "position": ["right of", 0]}]}
    cat, dog = det("cat", 0), det("dog", 30)
    assert clauses(m, [cat, dog], {cat: "black"}.__getitem__) == [True, True, True, True]
    assert clauses(m, [cat, dog], {cat: "white"}.__getitem__) == [True, False, True, False]


def test_exclusions():
    m = {"include": [{"class": "cat", "count": 1}], "exclude": [{"class": "dog", "count": 1},
                                                               {"class": "cat", "count": 3}]}
    assert clauses(m, [det("cat", 0)], no_colour) == [True, True, True]
    assert clauses(m, [det("cat", 0), det("dog", 20)], no_colour) == [True, False, True]
    assert clauses(m, [det("cat", 20 * i) for i in range(3)], no_colour) == [True, True, False]


@pytest.mark.parametrize("tag", list(GENEVAL))
def test_a_geneval_prompt_of_each_tag(tag):
    m = GENEVAL[tag]
    good = {"single_object": [det("bench", 0)],
            "two_object": [det("bench", 0), det("sports ball", 30)],
            "counting": [det("clock", 0), det("clock", 30)],
            "colors": [det("fire hydrant", 0)],
            "position": [det("teddy bear", 0), det("dog", 30)],
            "color_attr": [det("wine glass", 0), det("apple", 30)]}[tag]
    colours = {"fire hydrant": "blue", "wine glass": "purple", "apple": "black"}
    verdicts = clauses(m, good, lambda d: colours[d.label])
    assert verdicts and all(verdicts)
    assert not all(clauses(m, good[:-1], lambda d: colours[d.label]))
    if tag in ("colors", "color_attr"):
        assert not all(clauses(m, good, lambda d: "white"))


def test_select_thresholds_caps_and_suppresses_per_class():
    cats = [det("cat", 0, score=0.9), det("cat", 1, score=0.8), det("cat", 40, score=0.3), det("cat", 60, score=0.5)]
    dog = det("dog", 1, score=0.7)
    assert select(cats + [dog], 0.3, 16, 1.0) == cats[:2] + [cats[3], dog]  # above 0.3, not at it; no suppression
    assert select(cats + [dog], 0.3, 2, 1.0) == cats[:2] + [dog]
    # IoU of cats 0 and 1, inclusive pixels: 10 * 11 / (2 * 121 - 110) = 0.833; the dog is another class
    assert select(cats + [dog], 0.3, 16, 0.8) == [cats[0], cats[3], dog]
    assert select(cats + [dog], 0.3, 16, 0.9) == cats[:2] + [cats[3], dog]


def test_prompts_without_geneval_metadata_are_refused_by_name():
    with pytest.raises(ValueError, match="'a photo of a cat'.*no `include`"):
        checked(DataPrompt("a photo of a cat", {}))
    with pytest.raises(ValueError, match="'p'.*'teal'"):
        checked(DataPrompt("p", {"include": [{"class": "cat", "count": 1, "color": "teal"}]}))
    with pytest.raises(ValueError, match="'p'.*position"):
        checked(DataPrompt("p", {"include": [{"class": "cat", "count": 1, "position": ["above", 0]}]}))
    with pytest.raises(ValueError, match="'p'.*count >= 1"):
        checked(DataPrompt("p", {"include": [{"class": "cat"}]}))
    assert checked(DataPrompt("p", GENEVAL["position"])) is GENEVAL["position"]


class FakeDetector:
    """Returns the detections given for each prompt's classes, whatever the image."""
    def __init__(self, found: dict[tuple[str, ...], list[Detection]], kind: str = "owlv2"):
        self.found, self.calls, self.kind = found, [], kind

    def __call__(self, images, queries):
        self.calls.append(len(images))
        return [self.found[tuple(q)] for q in queries]


def fake_geneval(detector: FakeDetector, colours: dict[str, str], **options) -> tuple[GenEval, list]:
    """A GenEval scorer without models: `detector` finds, `colours` names each label's colour; the
    second value lists the labels each colour pass was asked about."""
    scorer = GenEval.__new__(GenEval)
    RewardModel.__init__(scorer, GenEvalOptions(**options), CPU)
    scorer.detector, asked = detector, []
    def colour_pass(crops, labels):
        asked.append(list(labels))
        return [colours[o] for o in labels]
    scorer.colours = colour_pass
    return scorer, asked


COUNTING_FOUND = {("clock",): [det("clock", 0, score=0.95), det("clock", 30, score=0.95), det("clock", 60, score=0.5)],
                  ("fire hydrant",): [det("fire hydrant", 2)],
                  ("wine glass", "apple"): [det("wine glass", 0), det("apple", 30)]}
COLOURS = {"fire hydrant": "blue", "wine glass": "purple", "apple": "red"}


def test_partial_credit_is_the_fraction_and_strict_is_all():
    """The reward's wiring without models: the per-tag threshold, the crops sent to CLIP in one
    pass, the mean and the all of the verdicts."""
    scorer, asked = fake_geneval(FakeDetector(COUNTING_FOUND), COLOURS, batch_size=2)
    prompts = [DataPrompt("two clocks", GENEVAL["counting"]), DataPrompt("a blue fire hydrant", GENEVAL["colors"]),
               DataPrompt("a purple wine glass and a black apple", GENEVAL["color_attr"])]
    images = np.zeros((3, 3, 32, 32), np.float32)
    # the third clock scores 0.5: under the counting threshold (0.9), so exactly two count
    np.testing.assert_allclose(scorer(images, prompts, [{}] * 3), [1.0, 1.0, 3 / 4])
    np.testing.assert_array_equal(scorer.strict(images, prompts, [{}] * 3), [1.0, 1.0, 0.0])
    assert scorer.detector.calls == [2, 1, 2, 1] and asked == [["fire hydrant", "wine glass", "apple"]] * 2
    counting_low = {**GENEVAL["counting"], "tag": "two_object"}  # the plain threshold (0.3): three clocks
    assert scorer.verdicts(images[:1], [DataPrompt("two clocks", counting_low)]) == [[True, False]]
    flow, _ = fake_geneval(FakeDetector(COUNTING_FOUND), COLOURS, partial="flow_grpo")
    # counting exact: 1; colour right: (1 + 1) / 2; the apple is red, not black: (1 + 1 + 1 + 0) / 4
    np.testing.assert_allclose(flow(images, prompts, [{}] * 3), [1.0, 1.0, 3 / 4])
    np.testing.assert_array_equal(flow.strict(images, prompts, [{}] * 3), [1.0, 1.0, 0.0])
    assert flow(images[:1], [DataPrompt("two clocks", counting_low)], [{}])[0] == 0.5  # three found: 1 - 1/2


def test_thresholds_are_the_detectors_own():
    clocks = [det("clock", 40 * i, score=s) for i, s in enumerate((0.95, 0.7, 0.5))]
    prompt = [DataPrompt("two clocks", GENEVAL["counting"])]
    images = np.zeros((1, 3, 32, 32), np.float32)
    thresholds = {"owlv2": {"counting": 0.6}, "grounding_dino": {"counting": 0.4}}
    owl, _ = fake_geneval(FakeDetector({("clock",): clocks}, "owlv2"), {}, thresholds=thresholds)
    dino, _ = fake_geneval(FakeDetector({("clock",): clocks}, "grounding_dino"), {}, thresholds=thresholds)
    assert owl.verdicts(images, prompt) == [[True, True]]     # two above 0.6
    assert dino.verdicts(images, prompt) == [[True, False]]   # three above 0.4
    assert GenEvalOptions(thresholds={"owlv2": {"score": 0.2}}).thresholds.grounding_dino.score == 0.3
    with pytest.raises(ValueError, match="counting"):
        GenEvalOptions(thresholds={"owlv2": {"counting": 1.5}})
    with pytest.raises(ValueError, match="mask2former"):
        GenEvalOptions(thresholds={"mask2former": {"score": 0.3}})


# --- Flow-GRPO's partial credit ------------------------------------------------------------------ #

@pytest.mark.parametrize("found, expected", [(0, 0.0), (1, 0.5), (2, 1.0), (3, 0.5), (4, 0.0), (5, -0.5)])
def test_flow_grpo_wants_the_exact_count(found, expected):
    clocks = [det("clock", 20 * i, score=0.9 - 0.01 * i) for i in range(found)]
    assert flow_grpo_credit(GENEVAL["counting"], clocks, no_colour) == expected
    assert np.mean(clauses(GENEVAL["counting"], clocks, no_colour)) == (1.0 if found == 2 else 0.5)


def test_flow_grpo_colour_and_position_entries():
    m = {"include": [{"class": "cat", "count": 1},
                     {"class": "dog", "count": 2, "color": "red", "position": ["right of", 0]}]}
    cat, right, left = det("cat", 0), [det("dog", 30, score=0.9), det("dog", 60, score=0.8)], det("dog", -30, score=0.8)
    red = lambda d: "red"
    assert flow_grpo_credit(m, [cat, *right], red) == 1.0                       # [1] + [1, 1, 1]
    half = lambda d: "red" if d.score > 0.85 else "blue"
    assert flow_grpo_credit(m, [cat, *right], half) == (1 + 1 + 0.5) / 3          # colour 1/2; position not read
    assert flow_grpo_credit(m, [cat, right[0], left], red) == (1 + 1 + 1 + 0 + 1) / 5  # a relation fails: 0, then 1
    assert flow_grpo_credit(m, [right[0], left], red) == (0 + 1 + 1 + 0) / 4      # no cat: the target failed, 0
    assert flow_grpo_credit(m, [cat, right[0]], red) == (1 + 0.5 + 0) / 3         # one dog of two: one 0 for both
    with_exclude = {**m, "exclude": [{"class": "cat", "count": 1}]}
    assert flow_grpo_credit(with_exclude, [cat, *right], red) == 1.0                # excludes are not read


# --- against the references, transcribed ---------------------------------------------------------- #
# Written from github djghosh13/geneval at af4902f `evaluation/evaluate_images.py` (`compute_iou`,
# `relative_position`, `evaluate`, the box selection in `evaluate_image`) and github
# yifan123/reward-server at 92ac29f `reward_server/gen_eval.py` (`evaluate_reward`), on their data:
# per class a list of (bbox [x0, y0, x1, y1, score], mask) most confident first, `colour_of(bbox)`
# standing in for the CLIP colour classification of those boxes.

def ref_iou(box_a, box_b):
    area_fn = lambda box: max(box[2] - box[0] + 1, 0) * max(box[3] - box[1] + 1, 0)
    i_area = area_fn([max(box_a[0], box_b[0]), max(box_a[1], box_b[1]),
                      min(box_a[2], box_b[2]), min(box_a[3], box_b[3])])
    u_area = area_fn(box_a) + area_fn(box_b) - i_area
    return i_area / u_area if u_area else 0


def ref_relative_position(obj_a, obj_b, position_threshold):
    boxes = np.array([obj_a[0], obj_b[0]])[:, :4].reshape(2, 2, 2)
    center_a, center_b = boxes.mean(axis=-2)
    dim_a, dim_b = np.abs(np.diff(boxes, axis=-2))[..., 0, :]
    offset = center_a - center_b
    revised_offset = np.maximum(np.abs(offset) - position_threshold * (dim_a + dim_b), 0) * np.sign(offset)
    if np.all(np.abs(revised_offset) < 1e-3):
        return set()
    dx, dy = revised_offset / np.linalg.norm(offset)
    relations = set()
    if dx < -0.5: relations.add("left of")
    if dx > 0.5: relations.add("right of")
    if dy < -0.5: relations.add("above")
    if dy > 0.5: relations.add("below")
    return relations


def ref_select(bbox, metadata, threshold, counting_threshold, max_objects, nms_threshold):
    """`evaluate_image`'s box selection: `bbox` is per class an (n, 5) array."""
    detected = {}
    confidence_threshold = threshold if metadata["tag"] != "counting" else counting_threshold
    for classname, boxes in bbox.items():
        ordering = np.argsort(boxes[:, 4])[::-1]
        ordering = ordering[boxes[ordering, 4] > confidence_threshold]
        ordering = ordering[:max_objects].tolist()
        detected[classname] = []
        while ordering:
            max_obj = ordering.pop(0)
            detected[classname].append((boxes[max_obj], None))
            ordering = [obj for obj in ordering
                        if nms_threshold == 1 or ref_iou(boxes[max_obj], boxes[obj]) < nms_threshold]
        if not detected[classname]:
            del detected[classname]
    return detected


def ref_evaluate(objects, metadata, colour_of, position_threshold):
    """GenEval's `evaluate`: (correct, reasons)."""
    correct, reason, matched_groups = True, [], []
    for req in metadata.get("include", []):
        classname = req["class"]
        matched = True
        found_objects = objects.get(classname, [])[:req["count"]]
        if len(found_objects) < req["count"]:
            correct = matched = False
            reason.append("count")
        else:
            if "color" in req:
                colors = [colour_of(box) for box, _ in found_objects]
                if colors.count(req["color"]) < req["count"]:
                    correct = matched = False
                    reason.append("colour")
            if "position" in req and matched:
                expected_rel, target_group = req["position"]
                if matched_groups[target_group] is None:
                    correct = matched = False
                    reason.append("no target")
                else:
                    for obj in found_objects:
                        for target_obj in matched_groups[target_group]:
                            if expected_rel not in ref_relative_position(obj, target_obj, position_threshold):
                                correct = matched = False
                                reason.append("relation")
                                break
                        if not matched:
                            break
        matched_groups.append(found_objects if matched else None)
    for req in metadata.get("exclude", []):
        if len(objects.get(req["class"], [])) >= req["count"]:
            correct = False
            reason.append("exclude")
    return correct, reason


def ref_evaluate_reward(objects, metadata, colour_of, position_threshold):
    """reward-server's `evaluate_reward`: (strict correct, score, reasons)."""
    correct, reason, rewards, matched_groups = True, [], [], []
    for req in metadata.get("include", []):
        classname = req["class"]
        matched = True
        found_objects = objects.get(classname, [])
        rewards.append(1 - abs(req["count"] - len(found_objects)) / req["count"])
        if len(found_objects) != req["count"]:
            correct = matched = False
            reason.append("count")
            if "color" in req or "position" in req:
                rewards.append(0.0)
        else:
            if "color" in req:
                colors = [colour_of(box) for box, _ in found_objects]
                rewards.append(1 - abs(req["count"] - colors.count(req["color"])) / req["count"])
                if colors.count(req["color"]) != req["count"]:
                    correct = matched = False
                    reason.append("colour")
            if "position" in req and matched:
                expected_rel, target_group = req["position"]
                if matched_groups[target_group] is None:
                    correct = matched = False
                    reason.append("no target")
                    rewards.append(0.0)
                else:
                    for obj in found_objects:
                        for target_obj in matched_groups[target_group]:
                            if expected_rel not in ref_relative_position(obj, target_obj, position_threshold):
                                correct = matched = False
                                reason.append("relation")
                                rewards.append(0.0)
                                break
                        if not matched:
                            break
                    rewards.append(1.0)
        matched_groups.append(found_objects if matched else None)
    reward = sum(rewards) / len(rewards) if rewards else 0
    return correct, reward, reason


CLASSES = ("cat", "dog", "clock")  # few, so that clauses, excludes and detections often share a class
SOME_COLOURS = ("red", "blue")


def random_case(rng):
    """A random GenEval prompt (1-3 include clauses, colours, positions, 0-2 excludes), random
    detections of its classes and others (coarse boxes and scores, so ties and overlaps happen), a
    colour for each, and random selection settings."""
    include = []
    for i in range(rng.integers(1, 4)):
        req = {"class": str(rng.choice(CLASSES)), "count": int(rng.integers(1, 4))}
        if rng.random() < 0.4:
            req["color"] = str(rng.choice(SOME_COLOURS))
        if i and rng.random() < 0.5:
            req["position"] = [str(rng.choice(["left of", "right of", "above", "below"])), int(rng.integers(0, i))]
        include.append(req)
    exclude = [{"class": str(rng.choice(CLASSES)), "count": int(rng.integers(1, 5))} for _ in range(rng.integers(0, 3))]
    metadata = {"tag": str(rng.choice(["counting", "two_object", "position"])), "include": include, "exclude": exclude}
    detections = []
    for label in (*CLASSES, "bench"):
        for _ in range(rng.integers(0, 6)):
            x0, y0 = rng.integers(0, 12, 2) * 8
            w, h = rng.integers(1, 6, 2) * 8
            detections.append(Detection(label, float(rng.integers(1, 20)) / 20 + float(rng.random()) * 1e-3,
                                        (float(x0), float(y0), float(x0 + w), float(y0 + h))))
    colours = {(d.label, d.score, d.box): str(rng.choice(SOME_COLOURS)) for d in detections}
    settings = dict(threshold=float(rng.choice([0.1, 0.3])), counting_threshold=float(rng.choice([0.5, 0.9])),
                    max_objects=int(rng.choice([2, 16])), max_overlap=float(rng.choice([0.3, 0.6, 1.0])),
                    margin=float(rng.choice([0.0, 0.1, 0.3])))
    return metadata, detections, colours, settings


def test_strict_and_flow_grpo_agree_with_the_references_on_random_detections():
    rng = np.random.default_rng(0)
    seen, credits, strict = set(), [], []
    for _ in range(3000):
        m, detections, colours, s = random_case(rng)
        threshold = s["counting_threshold"] if m["tag"] == "counting" else s["threshold"]
        kept = select(detections, threshold, s["max_objects"], s["max_overlap"])
        colour_of = lambda d: colours[(d.label, d.score, d.box)]
        bbox = {label: np.array([[*d.box, d.score] for d in detections if d.label == label]).reshape(-1, 5)
                for label in dict.fromkeys(d.label for d in detections)}
        objects = ref_select(bbox, m, s["threshold"], s["counting_threshold"], s["max_objects"], s["max_overlap"])
        ref_colour = lambda box: colours[next((d.label, d.score, d.box) for d in detections
                                              if d.box == tuple(box[:4]) and d.score == box[4])]
        correct, reasons = ref_evaluate(objects, m, ref_colour, s["margin"])
        _, reward, reward_reasons = ref_evaluate_reward(objects, m, ref_colour, s["margin"])
        assert {label: [d.box for d in ds] for label, ds in ranked(kept).items()} == \
            {label: [tuple(b[:4]) for b, _ in objs] for label, objs in objects.items()}
        assert all(clauses(m, kept, colour_of, s["margin"])) == correct, (m, kept)
        credit = flow_grpo_credit(m, kept, colour_of, s["margin"])
        assert credit == pytest.approx(reward, abs=1e-12), (m, kept)
        seen |= {f"strict {r}" for r in reasons} | {f"flow_grpo {r}" for r in reward_reasons}
        credits.append(credit)
        strict.append(correct)
    # every branch of both references was taken, and the credit ran over its whole range
    assert seen == {f"{ref} {r}" for ref in ("strict", "flow_grpo") for r in ("count", "colour", "no target", "relation")} \
        | {"strict exclude"}
    assert min(credits) < 0 and 0.02 < np.mean(np.array(credits) == 1) < 0.5 and 0.02 < np.mean(strict) < 0.5


# --- the tiny models ------------------------------------------------------------------------------ #

@pytest.fixture(scope="module")
def one_thread():
    """One torch thread, as reward actors score with (cluster/reward_pool.py): on two shared cores a
    second thread mostly waits for the first."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def owl(one_thread):
    return GenEval(GenEvalOptions(model="tiny:owlv2", clip_model="tiny:clip", batch_size=4), CPU)


@pytest.fixture(scope="module")
def grounding(one_thread):
    return GenEval(GenEvalOptions(model="tiny:grounding_dino", clip_model="tiny:clip", batch_size=4), CPU)


def batch(n: int = 6, seed: int = 0):
    images = np.random.default_rng(seed).uniform(-1, 1, (n, 3, 32, 32)).astype(np.float32)
    tags = list(GENEVAL)
    return images, [DataPrompt(f"prompt {i}", GENEVAL[tags[i % len(tags)]]) for i in range(n)]


@pytest.mark.parametrize("scorer", ["owl", "grounding"])
def test_the_tiny_detectors_score_a_batch_as_one_by_one(scorer, request):
    scorer = request.getfixturevalue(scorer)
    images, prompts = batch()
    scores = scorer(images, prompts, [{}] * len(prompts))
    assert scores.shape == (6,) and np.all((scores >= 0) & (scores <= 1))
    np.testing.assert_array_equal(scores, scorer(images, prompts, [{}] * len(prompts)))  # deterministic
    alone = [scorer(images[i:i + 1], prompts[i:i + 1], [{}])[0] for i in range(len(prompts))]
    np.testing.assert_allclose(scores, alone, atol=1e-6)
    strict = scorer.strict(images, prompts, [{}] * len(prompts))
    assert set(strict) <= {0.0, 1.0} and np.all(strict <= scores) and np.all((strict == 1) == (scores == 1))
    assert len(set(scores.tolist())) > 1  # the verdicts depend on the image and the prompt
    options = scorer.options
    try:
        scorer.options = options.model_copy(update={"partial": "flow_grpo"})
        flow = scorer(images, prompts, [{}] * len(prompts))
        alone = [scorer(images[i:i + 1], prompts[i:i + 1], [{}])[0] for i in range(len(prompts))]
    finally:
        scorer.options = options
    np.testing.assert_allclose(flow, alone, atol=1e-6)
    assert np.all(flow <= 1) and not np.allclose(flow, scores)  # random boxes: counts far from exact, credit < 0


def test_a_detector_of_the_wrong_kind_is_refused(owl):
    with pytest.raises(ValueError, match="model_type 'owlv2'; the detector must be grounding_dino"):
        GenEval(GenEvalOptions(model="tiny:owlv2", clip_model="tiny:clip", detector="grounding_dino"), CPU)


def test_owl_post_processing_agrees_with_the_processor(owl):
    from PIL import Image
    detector = owl.detector
    rng = np.random.default_rng(1)
    images = [Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)) for _ in range(3)]
    queries = [["cat", "dog"], ["traffic light", "cat"], ["dog", "bench"]]
    with torch.no_grad():
        outputs = detector.model(**detector.encode(images, queries))
    sizes = [(32, 32), (32, 48), (64, 40)]  # (h, w); OWLv2 boxes scale by the longer side
    mine = owl_detections(outputs.logits, outputs.pred_boxes, queries, sizes)
    theirs = detector.processor.image_processor.post_process_object_detection(outputs, threshold=-1.0,
                                                                              target_sizes=sizes)
    for found, ref, labels in zip(mine, theirs, queries):
        assert [d.label for d in found] == [labels[i] for i in ref["labels"].tolist()]
        np.testing.assert_allclose([d.score for d in found], ref["scores"].numpy(), rtol=1e-6)
        np.testing.assert_allclose([d.box for d in found], ref["boxes"].numpy(), rtol=1e-5, atol=1e-4)


def test_grounding_post_processing_agrees_with_the_processor(grounding):
    """The processor scores a box by its best token, separators included, where a class scores by
    its own tokens: the boxes agree, and the scores wherever the best token is in a class."""
    from PIL import Image
    detector = grounding.detector
    rng = np.random.default_rng(2)
    images = [Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)) for _ in range(2)]
    queries = [["cat", "traffic light"], ["dog"]]
    inputs = detector.encode(images, queries)
    with torch.no_grad():
        outputs = detector.model(**inputs)
    spans = detector.spans(queries)
    assert [[len(s) for s in row] for row in spans] == [[3, 13], [3]]  # bytes: one token a letter
    sizes = [(32, 32), (24, 40)]
    mine = grounding_detections(outputs.logits, outputs.pred_boxes, spans, queries, sizes=sizes)
    theirs = detector.processor.post_process_grounded_object_detection(
        outputs, inputs["input_ids"], threshold=-1.0, text_threshold=1.0, target_sizes=sizes)
    probs = torch.sigmoid(outputs.logits)
    for row, (found, ref) in enumerate(zip(mine, theirs)):
        np.testing.assert_allclose([d.box for d in found], ref["boxes"].numpy(), rtol=1e-5, atol=1e-4)
        scores = np.array([d.score for d in found])
        assert np.all(scores <= ref["scores"].numpy() + 1e-6)
        in_class = np.isin(probs[row].argmax(-1).numpy(), sum(spans[row], []))
        assert in_class.any()
        np.testing.assert_allclose(scores[in_class], ref["scores"].numpy()[in_class], rtol=1e-6)
