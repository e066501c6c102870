"""`tiny:wan2.1`, `tiny:wan2.2_a14b`, `tiny:wan2.2_ti2v`: tiny random `WanPipeline`s in the diffusers
layout, one per layout of the Wan checkpoints jointrl serves (experts/wan.py).

- wan2.1: one `WanTransformer3DModel` on the 16-channel latents of the Wan2.1 VAE (8x spatial, 4x
  temporal compression), as Wan2.1-T2V-1.3B and 14B;
- wan2.2_a14b: the same with a second transformer (`transformer_2`, the low-noise one) and Wan2.2
  A14B's `boundary_ratio` 0.875; its two transformers are seeded apart, so that a test sees which
  one ran;
- wan2.2_ti2v: Wan2.2-TI2V-5B's layout: the Wan2.2 VAE (residual, 2x2 patchified input, 16x spatial
  compression, 48 latent channels) and `expand_timesteps` (a timestep per latent token).

Each has a tiny UMT5 encoder over bytes and the scheduler the real checkpoints ship
(`UniPCMultistepScheduler` with flow sigmas and Wan's flow_shift 3.0), so jointrl takes its flow
sigmas from that config as it does for a real checkpoint. The VAEs' latents_mean/std are not 0 and 1
(Wan2.1's are its real values, the class defaults; Wan2.2's are spread), so the normalisation is
exercised. The sizes follow diffusers' own fast tests of WanPipeline.
"""
from __future__ import annotations

from pathlib import Path

import torch

from common.tiny import register_tiny
from common.tiny_tokenizer import byte_tokenizer

TEXT_WIDTH = 32


def _text_side():
    """A byte tokenizer (pad first, then UMT5's </s> and <unk>) and a 2-layer UMT5 encoder of width 32."""
    from transformers import UMT5Config, UMT5EncoderModel
    tokenizer = byte_tokenizer(["<pad>", "</s>", "<unk>"], max_length=512)
    tokenizer.eos_token, tokenizer.unk_token = "</s>", "<unk>"
    torch.manual_seed(0)
    encoder = UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), d_model=TEXT_WIDTH, d_kv=8, d_ff=32, num_layers=2,
                                          num_heads=4, relative_attention_num_buckets=8, feed_forward_proj="gated-gelu",
                                          pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                          decoder_start_token_id=tokenizer.pad_token_id))
    return tokenizer, encoder


def _transformer(channels: int, seed: int):
    from diffusers import WanTransformer3DModel
    torch.manual_seed(seed)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                 in_channels=channels, out_channels=channels, text_dim=TEXT_WIDTH, freq_dim=256, ffn_dim=32, num_layers=2,
                                 cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32)


def _scheduler():
    from diffusers import UniPCMultistepScheduler
    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                   num_train_timesteps=1000)


def _save(out: Path, vae, transformer, transformer_2=None, *, boundary_ratio=None, expand_timesteps=False) -> Path:
    from diffusers import WanPipeline
    tokenizer, text_encoder = _text_side()
    WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=_scheduler(),
                transformer=transformer, transformer_2=transformer_2, boundary_ratio=boundary_ratio,
                expand_timesteps=expand_timesteps).save_pretrained(out)
    return Path(out)


def _wan21_vae():
    from diffusers import AutoencoderKLWan
    torch.manual_seed(0)
    return AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True])


@register_tiny("wan2.1")
def tiny_wan21(out: Path) -> Path:
    """Wan2.1-T2V's layout: one transformer (2 blocks, 2 heads of 12) on the Wan2.1 VAE's 16 channels."""
    return _save(out, _wan21_vae(), _transformer(16, seed=0))


@register_tiny("wan2.2_a14b")
def tiny_wan22_a14b(out: Path) -> Path:
    """Wan2.2-T2V-A14B's layout: a high-noise and a low-noise transformer, switched at boundary_ratio 0.875."""
    return _save(out, _wan21_vae(), _transformer(16, seed=0), _transformer(16, seed=1), boundary_ratio=0.875)


@register_tiny("wan2.2_ti2v")
def tiny_wan22_ti2v(out: Path) -> Path:
    """Wan2.2-TI2V-5B's layout: the Wan2.2 VAE (48 channels, 16x spatial) and a timestep per latent token."""
    from diffusers import AutoencoderKLWan
    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=3, z_dim=48, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
                           latents_mean=torch.linspace(-0.5, 0.5, 48).tolist(),
                           latents_std=torch.linspace(0.5, 2.0, 48).tolist(), dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           scale_factor_spatial=16, scale_factor_temporal=4, temperal_downsample=[False, True, True])
    return _save(out, vae, _transformer(48, seed=0), expand_timesteps=True)
