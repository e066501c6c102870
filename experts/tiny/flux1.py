"""`tiny:flux1`: a tiny random `FluxPipeline` (FLUX.1's transformer, a FLUX-style VAE, CLIP and T5
text encoders, FLUX.1's scheduler) in the diffusers layout; FLUX.1-dev by default (a guidance
embedding, dynamic shifting), FLUX.1-schnell's layout on request (neither: a fixed shift of 1).

The byte-level tokenizers end every text with an end token as CLIP's and T5's do (CLIP's also
begins it, and pads with it): CLIPTextModel pools at the first end token, so the pooled embedding is
read just after the prompt, as in the real model.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from common.tiny import register_tiny
from common.tiny_tokenizer import byte_tokenizer

LATENT_CHANNELS = 4  # the transformer reads 2x2 patches of them: 16 channels a token
TEXT_WIDTH = 16
CLIP_LENGTH = 77


def with_template(tokenizer, template: str):
    """`tokenizer`, adding its special tokens around each text as `template` ("<s> $A </s>") says."""
    from tokenizers.processors import TemplateProcessing
    tokens = [t for t in template.split() if t != "$A"]
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=template, special_tokens=[(t, tokenizer.convert_tokens_to_ids(t)) for t in tokens])
    return tokenizer


@register_tiny("flux1")
def tiny_flux1(out: Path, variant: Literal["dev", "schnell"] = "dev") -> Path:
    """A transformer of one double- and one single-stream block, width 32 (2 heads of 16), on 2x2
    patches of a 4-channel VAE latent at half the image's side (FLUX's VAE: no quant convs, its
    scaling and shift factors); 2-layer CLIP and T5 encoders of width 16. "dev": a guidance
    embedding and FLUX.1-dev's scheduler (dynamic shifting over image sequences of 256 to 4096);
    "schnell": neither, FLUX.1-schnell's fixed shift of 1."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel
    clip_tokenizer = with_template(byte_tokenizer(["<|endoftext|>", "<|startoftext|>"], max_length=CLIP_LENGTH),
                                   "<|startoftext|> $A <|endoftext|>")
    clip_tokenizer.bos_token, clip_tokenizer.eos_token = "<|startoftext|>", "<|endoftext|>"
    t5_tokenizer = with_template(byte_tokenizer(["<pad>", "</s>"], max_length=512), "$A </s>")
    t5_tokenizer.eos_token = "</s>"
    torch.manual_seed(0)
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(clip_tokenizer), hidden_size=TEXT_WIDTH, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=CLIP_LENGTH, hidden_act="quick_gelu",
        bos_token_id=clip_tokenizer.bos_token_id, eos_token_id=clip_tokenizer.eos_token_id,
        pad_token_id=clip_tokenizer.pad_token_id))
    t5 = T5EncoderModel(T5Config(
        vocab_size=len(t5_tokenizer), d_model=TEXT_WIDTH, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
        pad_token_id=t5_tokenizer.pad_token_id, eos_token_id=t5_tokenizer.eos_token_id, decoder_start_token_id=0))
    transformer = FluxTransformer2DModel(patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=1,
                                         num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                                         joint_attention_dim=TEXT_WIDTH, pooled_projection_dim=TEXT_WIDTH,
                                         guidance_embeds=variant == "dev", axes_dims_rope=(4, 6, 6))
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                        latent_channels=LATENT_CHANNELS, norm_num_groups=4, sample_size=32, scaling_factor=0.3611,
                        shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                                base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                                max_image_seq_len=4096) if variant == "dev" else \
        FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=False)
    FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=clip_tokenizer, text_encoder_2=t5,
                 tokenizer_2=t5_tokenizer, transformer=transformer).save_pretrained(out)
    return Path(out)
