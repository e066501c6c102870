"""Tiny random CLIP models for the CLIP-based reward terms (common/tiny.py `tiny:clip`, `tiny:aesthetic`).

`tiny_clip` saves a two-layer `CLIPModel` with a `CLIPProcessor` (a byte-level tokenizer, so any
prompt file reads, and a `CLIPImageProcessor`, PIL-backed without torchvision) in the layout `CLIPModel.from_pretrained` and
`AutoProcessor.from_pretrained` load, like `openai/clip-vit-large-patch14`; `tiny_aesthetic` adds
the LAION aesthetic head beside it, under the name `Aesthetic` looks for by default.
"""
from __future__ import annotations

from pathlib import Path

import torch

from common.tiny import register_tiny
from common.tiny_tokenizer import byte_tokenizer

PROJECTION = 32   # the embedding width: the aesthetic head's input
TEXT_LENGTH = 77  # CLIP's context, as the real tokenizers truncate to


def clip_tokenizer():
    """The byte tokenizer wrapped as CLIP's is, `<|startoftext|> … <|endoftext|>`: CLIP's text
    transformer pools the hidden state at the first `eos_token_id`, so every text must end with it.
    Its id must not be 2, which `CLIPTextTransformer` reads as a legacy config and pools at the
    largest token id instead."""
    from tokenizers import processors
    bos, eos = "<|startoftext|>", "<|endoftext|>"
    tokenizer = byte_tokenizer(["<pad>", eos, bos], max_length=TEXT_LENGTH)
    tokenizer.bos_token, tokenizer.eos_token = bos, eos
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", special_tokens=[(bos, tokenizer.bos_token_id), (eos, tokenizer.eos_token_id)])
    return tokenizer


@register_tiny("clip")
def tiny_clip(out: Path) -> Path:
    """`tiny:clip`: 32x32 images in 8x8 patches, hidden 32, two layers, embeddings of width 32."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor
    tokenizer = clip_tokenizer()
    torch.manual_seed(0)
    config = CLIPConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=TEXT_LENGTH,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8),
        projection_dim=PROJECTION)
    CLIPModel(config).save_pretrained(out)
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(out)
    return Path(out)


@register_tiny("aesthetic")
def tiny_aesthetic(out: Path) -> Path:
    """`tiny:aesthetic`: `tiny_clip` and a random aesthetic head whose widths shrink from the
    embedding width as the reference's do from 768 (768, 1024, 128, 64, 16 -> 1)."""
    from safetensors.torch import save_file

    from tasks.rewards.aesthetic import HEAD_FILE, AestheticHead
    tiny_clip(out)
    torch.manual_seed(0)
    head = AestheticHead((PROJECTION, 2 * PROJECTION, PROJECTION // 2, PROJECTION // 4, PROJECTION // 8))
    save_file(head.state_dict(), Path(out) / HEAD_FILE)
    return Path(out)
