"""Tiny random open-vocabulary detectors for the `geneval` reward (common/tiny.py `tiny:owlv2`).

`tiny_owlv2` saves an `Owlv2ForObjectDetection` with an `Owlv2Processor` in the layout of
`google/owlv2-base-patch16-ensemble`; `tiny_grounding_dino` a `GroundingDinoForObjectDetection`
with a `GroundingDinoProcessor` in that of `IDEA-Research/grounding-dino-tiny`. Both read any text
(byte-level tokenizers) and use the PIL image processors, so tests run tasks/rewards/geneval.py's
very loading, batching and post-processing code.
"""
from __future__ import annotations

from pathlib import Path

import torch

from common.tiny import register_tiny
from common.tiny_tokenizer import byte_tokenizer

IMAGE_SIZE = 32
TEXT_LENGTH = 64  # queries are padded to this ("a photo of a baseball glove" is 27 bytes)


def owl_tokenizer():
    """The byte tokenizer wrapped as OWL's CLIP tokenizer is, `<|startoftext|> … <|endoftext|>`,
    with the end token given the highest id: OWL's text tower pools at `input_ids.argmax(-1)`
    (transformers `Owlv2TextTransformer`), which is the end token only when it has the top id, as
    in CLIP's vocabulary (49407); a query's first id is > 0, as `Owlv2ForObjectDetection`'s query
    mask (`input_ids[..., 0] > 0`) takes it."""
    from tokenizers import processors
    bos, eos = "<|startoftext|>", "<|endoftext|>"
    tokenizer = byte_tokenizer(["<pad>", bos], max_length=TEXT_LENGTH)
    tokenizer.add_special_tokens({"eos_token": eos})
    tokenizer.bos_token = bos
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", special_tokens=[(bos, tokenizer.bos_token_id), (eos, tokenizer.eos_token_id)])
    return tokenizer


@register_tiny("owlv2")
def tiny_owlv2(out: Path) -> Path:
    """`tiny:owlv2`: 32x32 images in 8x8 patches (16 boxes), one-layer towers of width 16."""
    from transformers import Owlv2Config, Owlv2ForObjectDetection, Owlv2ImageProcessorPil, Owlv2Processor
    tokenizer = owl_tokenizer()
    torch.manual_seed(0)
    config = Owlv2Config(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=TEXT_LENGTH,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=IMAGE_SIZE, patch_size=8),
        projection_dim=16)
    Owlv2ForObjectDetection(config).save_pretrained(out)
    image_processor = Owlv2ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    Owlv2Processor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(out)
    return Path(out)


@register_tiny("grounding_dino")
def tiny_grounding_dino(out: Path) -> Path:
    """A Grounding DINO over a one-block-per-stage Swin (width 8) and a one-layer BERT (width 16),
    12 object queries. Width 64: its GroupNorms take 32 groups, and the coarsest level of a 32x32
    image is 1x1, where a group of one value is refused. Two decoder layers: transformers ties the
    box heads of layers 1.. to layer 0's and refuses a model with none to tie.
    The model splits its text into phrases at BERT's ids of `[CLS]`, `[SEP]`, `.` and `?` (101, 102,
    1012, 1029); in the byte tokenizer 101 and 102 are two rare bytes and there is no 1012, so a tiny
    model reads its text as one phrase (no matter for a random model)."""
    from transformers import (BertConfig, GroundingDinoConfig, GroundingDinoForObjectDetection,
                              GroundingDinoImageProcessorPil, GroundingDinoProcessor, SwinConfig)
    tokenizer = byte_tokenizer(["[PAD]", "[CLS]", "[SEP]"], max_length=TEXT_LENGTH)
    torch.manual_seed(0)
    backbone = SwinConfig(image_size=IMAGE_SIZE, patch_size=4, embed_dim=8, depths=[1, 1, 1, 1],
                          num_heads=[1, 1, 1, 1], window_size=2, out_features=["stage2", "stage3", "stage4"])
    text = BertConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=32, max_position_embeddings=TEXT_LENGTH, pad_token_id=tokenizer.pad_token_id)
    config = GroundingDinoConfig(backbone_config=backbone, text_config=text, num_queries=12, d_model=64,
                                 encoder_layers=1, decoder_layers=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                 encoder_attention_heads=2, decoder_attention_heads=2, encoder_n_points=2,
                                 decoder_n_points=2, max_text_len=TEXT_LENGTH)
    GroundingDinoForObjectDetection(config).save_pretrained(out)
    image_processor = GroundingDinoImageProcessorPil(size={"shortest_edge": IMAGE_SIZE, "longest_edge": IMAGE_SIZE})
    GroundingDinoProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(out)
    return Path(out)
