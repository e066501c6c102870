"""The CLIP-based reward terms (`clip_score`, `pickscore`, `aesthetic`) on tiny random models: their
contract (shape, determinism, batching, one forward per batch) and their formulas against the
references computed here by hand (CLIP cosine, torchmetrics' CLIPScore 100 * max(cos, 0),
PickScore's `logit_scale.exp() * cos`, the LAION aesthetic MLP)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoProcessor, CLIPModel
from transformers.modeling_outputs import BaseModelOutputWithPooling

from common.hub import local_model
from tasks.base import TextPrompt
from tasks.rewards import resolve
from tasks.rewards.aesthetic import HEAD_FILE
from tasks.rewards.base import pil_images

CPU = torch.device("cpu")
TERMS = {"clip_score": "tiny:clip", "pickscore": "tiny:clip", "aesthetic": "tiny:aesthetic"}
TEXTS = ["a red circle", "two blue squares left of a cat", "ünïcode ☃ prompt", "x", "a long prompt " * 12]


def make(name: str, **options):
    cls = resolve(name)
    return cls(cls.Options(model=TERMS[name], **options), CPU)


@pytest.fixture(scope="module")
def images():
    return np.random.default_rng(0).uniform(-1, 1, (len(TEXTS), 3, 40, 40)).astype(np.float32)


def prompts(texts=TEXTS):
    return [TextPrompt(t) for t in texts]


def score(scorer, images, texts=TEXTS):
    return scorer(images, prompts(texts), [{}] * len(texts))


@pytest.mark.parametrize("name", TERMS)
def test_contract(name, images):
    batched, single = make(name, batch_size=3), make(name, batch_size=1)
    scores = score(batched, images)
    assert scores.shape == (len(TEXTS),) and scores.dtype == np.float64 and np.isfinite(scores).all()
    np.testing.assert_array_equal(scores, score(batched, images))
    np.testing.assert_allclose(scores, score(single, images), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(scores[1:3], score(batched, images[1:3], TEXTS[1:3]), rtol=1e-5, atol=1e-6)
    assert not np.allclose(scores[:-1], score(batched, images[1:], TEXTS[:-1]))  # other images


@pytest.mark.parametrize("name", TERMS)
def test_one_forward_per_batch(name, images, monkeypatch):
    scorer = make(name, batch_size=3)
    calls = {"image": 0, "text": 0}
    for kind in calls:
        forward = getattr(scorer.clip.model, f"get_{kind}_features")

        def counted(*args, _kind=kind, _forward=forward, **kwargs):
            calls[_kind] += 1
            return _forward(*args, **kwargs)
        monkeypatch.setattr(scorer.clip.model, f"get_{kind}_features", counted)
    score(scorer, images)
    assert calls == {"image": 2, "text": 0 if name == "aesthetic" else 2}


@pytest.mark.parametrize("name", ["clip_score", "pickscore"])
def test_prompt_matters(name, images):
    scorer = make(name)
    other = ["a red circle and a dog", *TEXTS[1:]]  # the same start: the text is pooled at its end
    assert score(scorer, images)[0] != score(scorer, images, other)[0]


def test_aesthetic_reads_images_only(images):
    scorer = make("aesthetic")
    np.testing.assert_array_equal(score(scorer, images), score(scorer, images, ["anything"] * len(TEXTS)))


def test_tiny_builds_are_deterministic(tmp_path):
    from tasks.rewards.tiny.clip import tiny_aesthetic
    a, b = tiny_aesthetic(tmp_path / "a"), tiny_aesthetic(tmp_path / "b")
    for file in ("model.safetensors", HEAD_FILE):
        x, y = load_file(a / file), load_file(b / file)
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def reference_embeds(folder: str, images, texts):
    """Unit CLIP embeddings computed here, straight from `transformers`."""
    model, processor = CLIPModel.from_pretrained(folder).eval(), AutoProcessor.from_pretrained(folder)
    with torch.no_grad():
        image = model.get_image_features(**processor(images=pil_images(images), return_tensors="pt"))
        text = model.get_text_features(**processor(text=texts, padding=True, truncation=True, max_length=77,
                                                   return_tensors="pt"))
    image, text = (getattr(x, "pooler_output", x) for x in (image, text))  # transformers 5: a model output
    return image / image.norm(dim=-1, keepdim=True), text / text.norm(dim=-1, keepdim=True)


def test_clip_score_is_the_cosine(images):
    image, text = reference_embeds(local_model("tiny:clip"), images, TEXTS)
    expected = torch.nn.functional.cosine_similarity(image, text, dim=-1).double().numpy()
    np.testing.assert_allclose(score(make("clip_score", batch_size=2), images), expected, rtol=1e-5, atol=1e-6)


def test_clipscore_scale_is_torchmetrics_clip_score_of_each_pair(images, monkeypatch):
    """torchmetrics' `clip_score(image, text)` of one pair is max(100 * cos, 0) (it clamps a batch's
    mean; of one pair, the pair's score), on embeddings whose cosines are known: 0.8, -0.6, 1, 0.
    (The random tiny CLIP gives every pair here a negative cosine, so fixed embeddings it is.)"""
    scorer = make("clip_score", scale="clipscore")
    image = torch.tensor([[3.0, 4.0, 0.0], [3.0, 4.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 2.0]])
    text = torch.tensor([[0.0, 1.0, 0.0], [-1.0, 0.0, 0.0], [2.0, 0.0, 0.0], [1.0, 1.0, 0.0]])
    monkeypatch.setattr(scorer.clip.model, "get_image_features",
                        lambda **kw: BaseModelOutputWithPooling(pooler_output=image))
    monkeypatch.setattr(scorer.clip.model, "get_text_features", lambda **kw: text)
    np.testing.assert_allclose(score(scorer, images[:4], TEXTS[:4]), [80.0, 0.0, 100.0, 0.0], atol=1e-5)
    cosine = make("clip_score")
    monkeypatch.setattr(cosine.clip.model, "get_image_features", lambda **kw: image)
    monkeypatch.setattr(cosine.clip.model, "get_text_features", lambda **kw: text)
    np.testing.assert_allclose(score(cosine, images[:4], TEXTS[:4]), [0.8, -0.6, 1.0, 0.0], atol=1e-7)
    with pytest.raises(ValueError, match="cosine"):
        resolve("clip_score").Options(scale="percent")


@pytest.mark.parametrize("scale", [None, 1.0])
def test_pickscore_formula_on_fixed_embeddings(scale, images, monkeypatch):
    scorer = make("pickscore", **({} if scale is None else {"scale": scale}))
    scorer.clip.model.logit_scale.data.fill_(math.log(100.0))
    image = torch.tensor([[3.0, 4.0, 0.0], [1.0, 0.0, 0.0]])
    text = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]])
    # as transformers 5 returns them (a model output), and as earlier versions did (a tensor)
    monkeypatch.setattr(scorer.clip.model, "get_image_features",
                        lambda **kw: BaseModelOutputWithPooling(pooler_output=image))
    monkeypatch.setattr(scorer.clip.model, "get_text_features", lambda **kw: text)
    expected = (1 / 26 if scale is None else scale) * 100.0 * np.array([4 / 5, 1.0])
    np.testing.assert_allclose(score(scorer, images[:2], TEXTS[:2]), expected, rtol=1e-6)


def test_pickscore_processor_option():
    from common.hub import ModelRef
    from tasks.rewards.clip import PICKSCORE_PROCESSOR
    cls = resolve("pickscore")
    assert cls(cls.Options(model="tiny:clip"), CPU).clip.processor is not None
    assert cls.processor_of(cls.Options(model="tiny:clip")) == "tiny:clip"
    assert cls.Options().processor is None and cls.default_model == "yuvalkirstain/PickScore_v1"
    # what `jointrl download` fetches: the model at its revision, another repo's processor without weights
    assert cls.models(cls.Options()) == [ModelRef("yuvalkirstain/PickScore_v1"),
                                         ModelRef(PICKSCORE_PROCESSOR, weights=False)]
    assert cls.models(cls.Options(model="org/pick", revision="abc", processor="org/pick")) == \
        [ModelRef("org/pick", "abc")]
    with pytest.raises(ValueError):
        cls.Options(scale=0)


def test_aesthetic_is_the_reference_mlp(images):
    folder = local_model("tiny:aesthetic")
    state = load_file(f"{folder}/{HEAD_FILE}")
    d = state["layers.0.weight"].shape[1]
    # the reference's MLP (improved-aesthetic-predictor simple_inference.py), at the tiny widths
    mlp = torch.nn.Sequential(
        torch.nn.Linear(d, 2 * d), torch.nn.Dropout(0.2), torch.nn.Linear(2 * d, d // 2), torch.nn.Dropout(0.2),
        torch.nn.Linear(d // 2, d // 4), torch.nn.Dropout(0.1), torch.nn.Linear(d // 4, d // 8),
        torch.nn.Linear(d // 8, 1)).eval()
    mlp.load_state_dict({k.removeprefix("layers."): v for k, v in state.items()})
    image, _ = reference_embeds(folder, images, TEXTS)
    with torch.no_grad():
        expected = mlp(image)[:, 0].double().numpy()
    np.testing.assert_allclose(score(make("aesthetic", batch_size=2), images), expected, rtol=1e-5, atol=1e-6)


def test_aesthetic_needs_a_head():
    cls = resolve("aesthetic")
    with pytest.raises(ValueError, match="no aesthetic head"):
        cls(cls.Options(model="tiny:clip"), CPU)
    head = f"{local_model('tiny:aesthetic')}/{HEAD_FILE}"
    assert np.isfinite(cls(cls.Options(model="tiny:clip", head=head), CPU)(np.zeros((1, 3, 8, 8)), prompts(["a"]), [{}])).all()
