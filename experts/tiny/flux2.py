"""`tiny:flux2_klein`: a tiny random `Flux2KleinPipeline` (FLUX.2's transformer, its VAE with the
batch-norm statistics of its patchified latents, a Qwen3 text encoder, FLUX.2's scheduler) in the
diffusers layout.

The pipeline reads the text encoder's hidden states after layers 9, 18 and 27 (its default
text_encoder_out_layers, which jointrl does not change), so the tiny Qwen3 has 28 layers, each 16
wide. Its byte-level tokenizer holds the chat tokens of Qwen3's template, whose generation prompt
with thinking off (as the pipeline asks) ends in an empty think block.
"""
from __future__ import annotations

from pathlib import Path

import torch

from common.tiny import register_tiny
from common.tiny_tokenizer import byte_tokenizer

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
                 "{% endif %}")
LATENT_CHANNELS = 4
TEXT_LAYERS = 28  # the pipeline stacks hidden_states[9], [18] and [27]
TEXT_WIDTH = 16


@register_tiny("flux2_klein")
def tiny_flux2_klein(out: Path) -> Path:
    """A transformer of one double- and one single-stream block, width 32 (2 heads of 16), on the
    2x2-patchified latents (16 channels) of a 4-channel VAE at half the image's side, whose batch
    norm holds non-trivial running statistics; a 28-layer Qwen3 of width 16 (its three read layers
    make the 48-wide text embedding); FLUX.2's scheduler config (FLUX.1-dev's: dynamic shifting)."""
    from diffusers import (AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline,
                           Flux2Transformer2DModel)
    from transformers import Qwen3Config, Qwen3ForCausalLM
    tokenizer = byte_tokenizer(SPECIAL, max_length=512)
    tokenizer.add_tokens(["user", "assistant"])  # one token each, as in Qwen's vocabulary
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(0)
    text_encoder = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=TEXT_WIDTH, intermediate_size=32, num_hidden_layers=TEXT_LAYERS,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=1024,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id))
    transformer = Flux2Transformer2DModel(patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=1,
                                          num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                                          joint_attention_dim=3 * TEXT_WIDTH, timestep_guidance_channels=32,
                                          axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False)
    vae = AutoencoderKLFlux2(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                             up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16),
                             layers_per_block=1, latent_channels=LATENT_CHANNELS, norm_num_groups=4, sample_size=32)
    channels = vae.bn.num_features
    vae.bn.running_mean.copy_(torch.linspace(-0.5, 0.5, channels))
    vae.bn.running_var.copy_(torch.linspace(0.5, 2.0, channels))
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                                base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                                max_image_seq_len=4096)
    Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                       transformer=transformer, is_distilled=False).save_pretrained(out)
    return Path(out)
