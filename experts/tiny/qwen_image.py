"""`tiny:qwen_image`: a tiny random `QwenImagePipeline` (Qwen-Image's MMDiT, its causal 3-D VAE, a
Qwen2.5-VL text encoder, Qwen-Image's scheduler) in the diffusers layout.

The pipeline wraps each prompt in a chat template and drops its first 34 tokens (the system turn,
as Qwen's tokenizer splits it); the byte-level tokenizer here holds that turn's words as whole tokens,
so that the same 34 tokens are dropped and what the transformer reads begins with the prompt.
"""
from __future__ import annotations

from pathlib import Path

import torch

from common.tiny import register_tiny
from common.tiny_tokenizer import byte_tokenizer

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
           "<|video_pad|>"]
# the template's system turn, word by word as Qwen's tokenizer splits it: with the chat tokens, its 34 tokens
TEMPLATE_WORDS = ["system", "user", "assistant", "\n", "Describe", " the", " image", " by", " detailing", " color",
                  ",", " shape", " size", " texture", " quantity", " text", " spatial", " relationships", " of",
                  " objects", " and", " background", ":"]
Z_DIM = 4


@register_tiny("qwen_image")
def tiny_qwen_image(out: Path) -> Path:
    """A 2-block transformer of width 32 (2 heads of 16) on 2x2 patches of a 4-channel VAE latent at a
    quarter of the image's side; a 2-layer text encoder of width 32; Qwen-Image's scheduler config
    (exponential dynamic shifting with its sequence-length range, terminal sigma 0.02)."""
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    tokenizer = byte_tokenizer(SPECIAL, max_length=1024 + 34)
    tokenizer.add_tokens(TEMPLATE_WORDS)
    tokenizer.eos_token = "<|im_end|>"
    ids = tokenizer.convert_tokens_to_ids
    torch.manual_seed(0)
    text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]},
                         bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32,
                           fullatt_block_indexes=[0]),
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>")))
    transformer = QwenImageTransformer2DModel(patch_size=2, in_channels=4 * Z_DIM, out_channels=Z_DIM, num_layers=2,
                                              attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                              axes_dims_rope=(8, 4, 4))
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=Z_DIM, dim_mult=[1, 2, 2], num_res_blocks=1,
                                 temperal_downsample=[False, True], latents_mean=[-0.3, 0.1, 0.2, -0.1],
                                 latents_std=[1.5, 0.8, 1.2, 2.0])
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
    QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                      transformer=transformer).save_pretrained(out)
    return Path(out)

