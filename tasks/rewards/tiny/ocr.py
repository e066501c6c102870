"""`tiny:trocr`: a tiny random TrOCR (ViT encoder + TrOCR decoder), in the layout of
`microsoft/trocr-base-printed`, so tests run tasks/rewards/ocr.py's very loading and generation code."""
from __future__ import annotations

from pathlib import Path

import torch

from common.tiny import register_tiny
from common.tiny_tokenizer import byte_tokenizer

IMAGE_SIZE = 32
STD = 0.3  # weights this large make what it reads depend on the image (0.02 reads the same for all)


@register_tiny("trocr")
def tiny_trocr(out: Path) -> Path:
    """A 32×32-input ViT (8×8 patches) feeding a two-layer TrOCR decoder over bytes. Generation starts
    at `<s>`, stops at `</s>` and pads with `<pad>`, all set in the model's config and its generation
    config, so `generate` needs no token arguments (as with the real checkpoint)."""
    from transformers import (TrOCRConfig, TrOCRForCausalLM, TrOCRProcessor, ViTConfig, ViTImageProcessorPil,
                              ViTModel, VisionEncoderDecoderModel)
    tokenizer = byte_tokenizer(["<pad>", "<s>", "</s>"], max_length=64)
    tokenizer.bos_token, tokenizer.eos_token = "<s>", "</s>"
    torch.manual_seed(0)
    encoder = ViTModel(ViTConfig(image_size=IMAGE_SIZE, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=64, initializer_range=STD))
    decoder = TrOCRForCausalLM(TrOCRConfig(
        vocab_size=len(tokenizer), d_model=32, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=64,
        max_position_embeddings=64, cross_attention_hidden_size=32, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.bos_token_id, init_std=STD))
    model = VisionEncoderDecoderModel(encoder=encoder, decoder=decoder)
    for config in (model.config, model.generation_config):
        config.decoder_start_token_id = tokenizer.bos_token_id
        config.pad_token_id = tokenizer.pad_token_id
        config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    image_processor = ViTImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                           image_mean=[0.5] * 3, image_std=[0.5] * 3)
    TrOCRProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(out)
    return Path(out)
