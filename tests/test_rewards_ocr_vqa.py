"""The `ocr` and `vqa_score` reward terms: their formulas against the references, re-implemented here
from the sources (Flow-GRPO's `flow_grpo/ocr.py`, VQAScore's P("Yes")); the OCR term on real weights
(PP-OCRv4, shipped in the rapidocr-onnxruntime wheel) reading phrases rendered with PIL; and the
scorers on tiny random TrOCR, Qwen2-VL and Qwen2.5-VL models: shape, range, determinism, batching,
and the VLM's inputs against the models' own processors."""
from __future__ import annotations

import functools
import math
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from common.hub import local_model
from tasks.base import TextPrompt
from tasks.rewards import resolve
from tasks.rewards.base import pil_images
from tasks.rewards.ocr import ocr_reward, quoted
from tasks.rewards.tiny.ocr import tiny_trocr
from tasks.rewards.tiny.vqa import tiny_qwen2_5_vl, tiny_qwen2_vl
from tasks.rewards.vqa import VQAScoreOptions, yes_probability
from tests.rendered_text import LAYOUTS, PHRASES, SIDE, rendered

CPU = torch.device("cpu")
TEXTS = ["a red circle", "two blue squares left of a cat on a long wooden bench", "ünïcode ☃", "x"]


def make(name: str, **options):
    cls = resolve(name)
    defaults = {"ocr": {"reader": "trocr", "model": "tiny:trocr"}, "vqa_score": {"model": "tiny:qwen2_vl"}}[name]
    return cls(cls.Options(**{**defaults, **options}), CPU)


def score(scorer, images, texts):
    return scorer(images, [TextPrompt(t) for t in texts], [{}] * len(texts))


@pytest.fixture(scope="module")
def images():
    return np.random.default_rng(0).uniform(-1, 1, (len(TEXTS), 3, 64, 64)).astype(np.float32)


# --- OCR: Flow-GRPO's string metric -------------------------------------------------------------

def flow_grpo_ocr(prompt: str, recognized_text: str) -> float:
    """flow_grpo/ocr.py (yifan123/flow_grpo at ac4c86e) l.31 and l.46-60, as written there."""
    @functools.cache
    def distance(a: str, b: str) -> int:  # Levenshtein.distance, by its recursive definition
        if not a or not b:
            return len(a) + len(b)
        return min(distance(a[1:], b) + 1, distance(a, b[1:]) + 1, distance(a[1:], b[1:]) + (a[0] != b[0]))
    prompt = prompt.split('"')[1]
    recognized_text = recognized_text.replace(' ', '').lower()
    prompt = prompt.replace(' ', '').lower()
    if prompt in recognized_text:
        dist = 0
    else:
        dist = distance(recognized_text, prompt)
    if dist > len(prompt):
        dist = len(prompt)
    return 1 - dist / (len(prompt))


@pytest.mark.parametrize("target, read, expected", [
    ("OPEN 24 HOURS", "OPEN 24 HOURS", 1.0),         # identical
    ("HELLO", "HELLA", 1 - 1 / 5),                   # one substitution
    ("Open 24 Hours", "open24HOURS", 1.0),           # case and spaces do not count
    ("Hello World", "  HELLO   WORLD ", 1.0),
    ("a b", "a\nb", 1 - 1 / 2),                      # only ' ' is removed: the newline is one insertion
    ("HELLO", "", 0.0),                              # nothing read: distance 5, reward 0
    ("cat", "the cat sat", 1.0),                     # the target inside a longer reading: distance 0
    ("abc", "abxc", 1 - 1 / 3),                      # one character too many
    ("HELLO", "HEL", 1 - 2 / 5),                     # a shorter reading: two deletions
    ("cat", "dog house xyz", 0.0),                   # distance 9 clipped at len("cat")
    ("Spring Collection", "spring colection", 1 - 1 / 16),
])
def test_ocr_reward_by_hand(target, read, expected):
    assert ocr_reward(target, read) == pytest.approx(expected, abs=1e-12)
    assert ocr_reward(target, read) == pytest.approx(flow_grpo_ocr(f'a sign that reads "{target}"', read), abs=1e-12)


def test_ocr_reward_is_flow_grpo():
    rng = np.random.default_rng(0)
    for _ in range(300):
        target, read = ("".join(rng.choice(list("aAb c"), size=rng.integers(lo, 9))) for lo in (1, 0))
        if target.replace(" ", ""):
            assert ocr_reward(target, read) == pytest.approx(flow_grpo_ocr(f'x "{target}" y', read), abs=1e-12)


def test_quoted():
    assert quoted('A neon sign that reads "OPEN 24 HOURS" at night') == "OPEN 24 HOURS"
    assert quoted('"first" then "second"') == "first"
    assert quoted('an unclosed "quote') == "quote"  # as Flow-GRPO's split('"')[1]
    with pytest.raises(ValueError, match="double quotes"):
        quoted("a sign with no quotes")
    with pytest.raises(ValueError, match="empty"):
        ocr_reward(" ", "anything")


# --- VQAScore: P(Yes) from logits ---------------------------------------------------------------

def test_yes_probability_by_hand():
    logits = torch.tensor([[0.0, math.log(3), 0.0, 0.0],             # exp: 1 3 1 1, sum 6
                           [math.log(2), 0.0, math.log(6), 0.0]])    # exp: 2 1 6 1, sum 10
    yes, no = 1, 2
    torch.testing.assert_close(yes_probability(logits, yes), torch.tensor([3 / 6, 1 / 10]))
    torch.testing.assert_close(yes_probability(logits, yes, no), torch.tensor([3 / 4, 1 / 7]))
    half = yes_probability(logits.bfloat16(), yes)
    assert half.dtype == torch.float32


def test_question_needs_the_prompt():
    assert "{prompt}" in VQAScoreOptions().question
    for bad in ("Is this a good image?", "Does it show {prompt} in {style}?", "Does it show {0}?"):
        with pytest.raises(ValueError, match="prompt"):
            VQAScoreOptions(question=bad)
    assert VQAScoreOptions(question="{{Yes}} if it shows {prompt}").question.format(prompt="a") == "{Yes} if it shows a"


# --- the tiny models -----------------------------------------------------------------------------

@pytest.mark.parametrize("builder", [tiny_trocr, tiny_qwen2_vl, tiny_qwen2_5_vl])
def test_tiny_builders_are_seeded(builder, tmp_path):
    start = time.perf_counter()
    weights = [load_file(builder(tmp_path / str(i)) / "model.safetensors") for i in range(2)]
    assert time.perf_counter() - start < 10  # two builds, each under 5 s
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


# --- OCR on real weights: PP-OCRv4 through rapidocr ----------------------------------------------

@pytest.fixture(scope="module")
def paddle():
    pytest.importorskip("rapidocr_onnxruntime", reason="the ocr extra: rapidocr-onnxruntime (Python < 3.13)")
    return resolve("ocr")(resolve("ocr").Options(threads=1), CPU)


@pytest.fixture(scope="module")
def phrases():
    rng = np.random.default_rng(0)
    return np.stack([rendered(t, *LAYOUTS[i % len(LAYOUTS)], rng) for i, t in enumerate(PHRASES)])


def test_ocr_reads_rendered_phrases_with_real_weights(paddle, phrases):
    right = score(paddle, phrases, [f'a sign that reads "{t}"' for t in PHRASES])
    other = score(paddle, phrases, [f'a sign that reads "{PHRASES[(i + 1) % len(PHRASES)]}"' for i in range(len(PHRASES))])
    noise = score(paddle, np.random.default_rng(1).uniform(-1, 1, (2, 3, SIDE, SIDE)).astype(np.float32),
                  ['"OPEN 24 HOURS"', '"Hello World"'])
    assert right.mean() >= 0.9, (right, paddle.read(phrases))
    assert other.max() <= 0.4, other
    assert noise.max() <= 0.1, noise


def test_ocr_reader_is_set_as_paddleocr_reads(paddle):
    engine = paddle.reader.engine
    post = engine.text_det.postprocess_op
    assert (post.thresh, post.box_thresh, post.unclip_ratio, post.dilation_kernel) == (0.3, 0.6, 1.5, None)
    assert list(engine.text_det.mean) == [0.485, 0.456, 0.406] and engine.text_score == 0.5
    assert not engine.use_cls and engine.text_det.limit_type == "max"


def test_a_failed_read_scores_zero_and_is_logged(paddle, phrases, monkeypatch, caplog):
    engine, calls = paddle.reader.engine, []
    def flaky(image):
        calls.append(image)
        if len(calls) == 2:
            raise RuntimeError("box geometry")
        return engine(image)
    monkeypatch.setattr(paddle.reader, "engine", flaky)
    with caplog.at_level("WARNING", logger="jointrl.reward"):
        scores = score(paddle, phrases[:2], [f'"{t}"' for t in PHRASES[:2]])
    assert scores[0] > 0.9 and scores[1] == 0 and "box geometry" in caplog.text


def test_ocr_options_belong_to_their_reader():
    options = resolve("ocr").Options
    with pytest.raises(ValueError, match="reader=trocr"):
        options(model="microsoft/trocr-base-printed")
    with pytest.raises(ValueError, match="rapidocr"):
        options(reader="trocr", det_model="det.onnx")
    assert options(reader="trocr").reader == "trocr" and options().det_model is None


# --- OCR on the tiny TrOCR -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def ocr():
    return make("ocr", batch_size=3, max_new_tokens=12)


def test_ocr_reads_as_generate(ocr, images):
    from transformers import AutoProcessor, VisionEncoderDecoderModel
    path = local_model("tiny:trocr")
    processor, model = AutoProcessor.from_pretrained(path), VisionEncoderDecoderModel.from_pretrained(path)
    tokens = model.generate(processor(images=pil_images(images[:1]), return_tensors="pt")["pixel_values"],
                            max_new_tokens=12, do_sample=False)
    read = ocr.read(images)
    assert read[0] == processor.batch_decode(tokens, skip_special_tokens=True)[0]
    assert len(set(read)) > 1  # what it reads depends on the image


def test_ocr_contract(ocr, images):
    reads = ocr.read(images)
    assert reads == ocr.read(images) == sum((ocr.read(images[i:i + 1]) for i in range(len(images))), [])
    # even rows quote the start of what is read there (less any '"', which would end the quote)
    targets = [r.replace('"', "")[:4] if i % 2 == 0 else t for i, (r, t) in enumerate(zip(reads, TEXTS))]
    assert all(t.replace(" ", "") for t in targets)
    texts = [f'a sign that reads "{t}" at night' for t in targets]
    scores = score(ocr, images, texts)
    assert scores.shape == (len(TEXTS),) and scores.dtype == np.float64
    assert ((0 <= scores) & (scores <= 1)).all()
    np.testing.assert_array_equal(scores, [ocr_reward(t, r) for t, r in zip(targets, reads)])
    assert (scores[::2] == 1).all()
    np.testing.assert_array_equal(scores, score(make("ocr", batch_size=1, max_new_tokens=12), images, texts))


def test_ocr_one_generate_per_batch(ocr, images, monkeypatch):
    calls = []
    generate = ocr.reader.model.generate
    monkeypatch.setattr(ocr.reader.model, "generate", lambda *a, **k: calls.append(1) or generate(*a, **k))
    score(ocr, images, [f'"{t}"' for t in TEXTS])
    assert len(calls) == 2  # 4 images in batches of 3


def test_ocr_refuses_prompts_without_quotes(ocr, images):
    with pytest.raises(ValueError, match="double quotes"):
        score(ocr, images[:2], ['"fine"', "no quotes here"])


# --- VQAScore on the tiny Qwen2-VL and Qwen2.5-VL ------------------------------------------------

VLMS = {"tiny:qwen2_vl": "Qwen2VLProcessor", "tiny:qwen2_5_vl": "Qwen2_5_VLProcessor"}


@pytest.fixture(scope="module", params=list(VLMS))
def vqa(request):
    return make("vqa_score", model=request.param, batch_size=3)


def vl_processor(model: str):
    """The model's own processor (`Qwen2VLProcessor`, `Qwen2_5_VLProcessor`), for images only.
    transformers 5 checks that its video processor is one, which needs torchvision (not installed
    here); the check alone is skipped."""
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.processing_utils import ProcessorMixin
    path = local_model(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ProcessorMixin, "check_argument_for_proper_class", lambda self, name, arg: type(arg))
        return getattr(transformers, VLMS[model])(image_processor=AutoImageProcessor.from_pretrained(path),
                                                  tokenizer=tokenizer, video_processor=None,
                                                  chat_template=tokenizer.chat_template)


def test_vqa_loads_either_family(vqa):
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration
    wanted = {"tiny:qwen2_vl": Qwen2VLForConditionalGeneration, "tiny:qwen2_5_vl": Qwen2_5_VLForConditionalGeneration}
    assert type(vqa.model) is wanted[vqa.options.model]
    with pytest.raises(ValueError, match="model_type 'clip'; vqa_score loads qwen2_vl or qwen2_5_vl"):
        make("vqa_score", model="tiny:clip")


def test_vqa_contract(vqa, images):
    model = vqa.options.model
    scores = score(vqa, images, TEXTS)
    assert scores.shape == (len(TEXTS),) and scores.dtype == np.float64
    assert ((0 < scores) & (scores < 1)).all()
    np.testing.assert_array_equal(scores, score(vqa, images, TEXTS))
    single = make("vqa_score", model=model, batch_size=1)  # prompts of different lengths: left padding must not matter
    np.testing.assert_allclose(scores, score(single, images, TEXTS), rtol=1e-5, atol=1e-9)
    assert len(set(scores.round(8))) == len(TEXTS)
    assert not np.allclose(scores[:-1], score(vqa, images[1:], TEXTS[:-1]))  # other images
    yes_no = score(make("vqa_score", model=model, over="yes_no"), images, TEXTS)
    assert ((0 < yes_no) & (yes_no < 1)).all() and (yes_no > scores).all()


def test_vqa_is_the_models_p_yes(vqa, images):
    """P(Yes) for one sample in a batch is what a plain forward pass of the model gives on the inputs
    the model's own processor makes from the chat template, the question and the image."""
    processor = vl_processor(vqa.options.model)
    i = 1  # the longest prompt: the others in its batch are left-padded
    chat = [{"role": "user", "content": [{"type": "image"},
                                         {"type": "text", "text": f'Does this figure show "{TEXTS[i]}"? '
                                                                  'Please answer Yes or No.'}]}]
    text = processor.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=pil_images(images[i:i + 1]), return_tensors="pt")
    mine = vqa.inputs(images[i:i + 1], TEXTS[i:i + 1])
    assert inputs.keys() == mine.keys() and all(torch.equal(inputs[k], mine[k]) for k in inputs)
    with torch.no_grad():
        probs = vqa.model(**inputs).logits[0, -1].softmax(-1)
    yes = processor.tokenizer.encode("Yes", add_special_tokens=False)[0]
    assert score(vqa, images, TEXTS)[i] == pytest.approx(probs[yes].item(), rel=1e-5)


def test_vqa_one_forward_per_batch(vqa, images):
    calls = []
    hook = vqa.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        score(vqa, images, TEXTS)
    finally:
        hook.remove()
    assert len(calls) == 2


def test_vqa_question_option(vqa, images):
    other = make("vqa_score", model=vqa.options.model, question="Is {prompt} in this picture? Answer Yes or No.")
    assert not np.allclose(score(vqa, images, TEXTS), score(other, images, TEXTS))
