"""`tiny:qwen2_vl`: a tiny random Qwen2-VL in the layout of `Qwen/Qwen2-VL-2B-Instruct` (model,
byte-level tokenizer with Qwen2-VL's special tokens and chat template, PIL image processor), so tests
run tasks/rewards/vqa.py's very loading, templating and padding code."""
from __future__ import annotations

from pathlib import Path

import torch

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


def tiny_qwen2_vl(out: Path) -> Path:
    """Two text layers of width 32 and one vision block of width 16; images are resized to between
    16×16 and 32×32 pixels, i.e. 4 to 16 image tokens (a 32×32 or 64×64 image gives 16)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil
    tokenizer = byte_tokenizer(SPECIAL, max_length=512)
    tokenizer.eos_token = "<|im_end|>"
    ids = tokenizer.convert_tokens_to_ids
    torch.manual_seed(0)
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
                         bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         initializer_range=STD),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=PATCH,
                           spatial_merge_size=MERGE, temporal_patch_size=2, initializer_range=STD),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))
    Qwen2VLForConditionalGeneration(config).save_pretrained(out)
    side = PATCH * MERGE
    Qwen2VLImageProcessorPil(min_pixels=(2 * side) ** 2, max_pixels=(4 * side) ** 2, patch_size=PATCH,
                             merge_size=MERGE, temporal_patch_size=2).save_pretrained(out)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return Path(out)
