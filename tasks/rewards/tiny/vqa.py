"""`tiny:qwen2_vl` and `tiny:qwen2_5_vl`: tiny random Qwen2-VL and Qwen2.5-VL models in the layout of
`Qwen/Qwen2-VL-2B-Instruct` and `Qwen/Qwen2.5-VL-3B-Instruct` (model, byte-level tokenizer with the
Qwen-VL special tokens and chat template, PIL image processor), so tests run tasks/rewards/vqa.py's
very loading, templating and padding code on both."""
from __future__ import annotations

from pathlib import Path

import torch

from common.tiny import register_tiny
from common.tiny_tokenizer import byte_tokenizer

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
           "<|video_pad|>"]
# Qwen2-VL-Instruct's template, for images and text only (no videos, no image numbering)
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PATCH, MERGE = 4, 2  # 8×8 pixels per image token
STD = 0.2  # weights ten times the usual 0.02, so that what it answers depends more on the image and question


def text_config(tokenizer) -> dict:
    """Two text layers of width 32 (head dim 8, split 2/1/1 between M-RoPE's time, height and width)."""
    return dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
                bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                initializer_range=STD)


def save(out: Path, model_class, config_class, tokenizer, *, vision: dict) -> Path:
    """The model (seeded), the image processor (images resized to between 16×16 and 32×32 pixels, i.e.
    4 to 16 image tokens: a 32×32 or 64×64 image gives 16) and the tokenizer with the chat template."""
    from transformers import Qwen2VLImageProcessorPil
    ids = tokenizer.convert_tokens_to_ids
    torch.manual_seed(0)
    config = config_class(text_config=text_config(tokenizer), vision_config=vision,
                          image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
                          vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))
    model_class(config).save_pretrained(out)
    side = PATCH * MERGE
    Qwen2VLImageProcessorPil(min_pixels=(2 * side) ** 2, max_pixels=(4 * side) ** 2, patch_size=PATCH,
                             merge_size=MERGE, temporal_patch_size=2).save_pretrained(out)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return Path(out)


def qwen_vl_tokenizer():
    tokenizer = byte_tokenizer(SPECIAL, max_length=512)
    tokenizer.eos_token = "<|im_end|>"
    return tokenizer


@register_tiny("qwen2_vl")
def tiny_qwen2_vl(out: Path) -> Path:
    """Qwen2-VL: one vision block of width 16 (full attention), merged into the text width."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    vision = dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=PATCH,
                  spatial_merge_size=MERGE, temporal_patch_size=2, initializer_range=STD)
    return save(out, Qwen2VLForConditionalGeneration, Qwen2VLConfig, qwen_vl_tokenizer(), vision=vision)


@register_tiny("qwen2_5_vl")
def tiny_qwen2_5_vl(out: Path) -> Path:
    """Qwen2.5-VL: two vision blocks of width 16, the first attending within windows of 16×16 pixels
    (2×2 merged tokens, so a 32×32 image has four windows), the second over the whole image, as
    Qwen2.5-VL alternates windowed and full blocks (`fullatt_block_indexes`); SwiGLU MLPs and
    RMSNorm, merged into the text width (`out_hidden_size`)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    vision = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=PATCH,
                  spatial_merge_size=MERGE, temporal_patch_size=2, window_size=2 * PATCH * MERGE,
                  fullatt_block_indexes=[1], initializer_range=STD)
    return save(out, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLConfig, qwen_vl_tokenizer(), vision=vision)
