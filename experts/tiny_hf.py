"""Tiny random Hugging Face models, built in-process, for tests and smoke runs without a hub.

`tiny_causal_lm(dir)`: a two-layer Qwen2-style LM with a word-level tokenizer (made with
`tokenizers`) over the shapes vocabulary, chat tokens and `<answer>`/`</answer>`, and a chat
template, saved as `AutoModelForCausalLM`/`AutoTokenizer` load it. `tiny_sd3(dir)`: an SD3-style
flow transformer, VAE, two CLIP text encoders with their tokenizers and a flow-matching scheduler,
saved in the diffusers layout (`model_index.json` and one folder per component).

    python -m experts.tiny_hf OUT_DIR   # writes OUT_DIR/qwen2 and OUT_DIR/sd3
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from common.tiny import register_tiny
from common.tiny_tokenizer import byte_tokenizer
from tasks.shapes import VOCAB

CHAT_TOKENS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "system", "user", "assistant", "<answer>", "</answer>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


def word_tokenizer(extra: list[str], max_length: int | None = None):
    """A whitespace word-level fast tokenizer over `extra` then the shapes words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = list(dict.fromkeys([*extra, *[w for w in VOCAB if not w.startswith("<")]]))
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>",
                                   model_max_length=max_length or 512)


def tiny_causal_lm(out: Path, seed: int = 0, text: str = "shapes", arch: str = "qwen2", *, head_dim: int = 8) -> Path:
    """`text`: "shapes" tokenizes the shapes words, "bytes" any text (common/tiny.py's `tiny:` models).
    `arch`: qwen2 or qwen3, with 4 query heads of `head_dim` (2 key-value heads): 8 by default, 32
    or more for vLLM's CPU attention, which refuses smaller heads (`tiny_engine_lm`)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM
    tokenizer = word_tokenizer(CHAT_TOKENS) if text == "shapes" else \
        byte_tokenizer(["<pad>", "<|im_start|>", "<|im_end|>", "<answer>", "</answer>"])
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = CHAT_TEMPLATE
    torch.manual_seed(seed)
    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[arch]
    config = config_cls(vocab_size=len(tokenizer), hidden_size=4 * head_dim, intermediate_size=8 * head_dim,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                        max_position_embeddings=256, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id, bos_token_id=None, tie_word_embeddings=False)
    model_cls(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return Path(out)


@register_tiny("qwen2_engine")
def tiny_engine_lm(out: Path, seed: int = 0, arch: str = "qwen2") -> Path:
    """The tiny causal LM over the shapes words with heads vLLM's CPU attention serves (head_dim 32)."""
    return tiny_causal_lm(out, seed, arch=arch, head_dim=32)


def tiny_sd3(out: Path, seed: int = 0, sample_size: int = 16, text: str = "shapes", *, num_layers: int = 2,
             num_heads: int = 4, head_dim: int = 8) -> Path:
    """An SD3-style pipeline (no T5) whose VAE halves the resolution: latents of side `sample_size`
    decode to images of twice that side; the transformer `num_layers` deep, `num_heads * head_dim`
    wide. `text` as in `tiny_causal_lm`."""
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection
    torch.manual_seed(seed)
    transformer = SD3Transformer2DModel(sample_size=sample_size, patch_size=2, in_channels=4, num_layers=num_layers,
                                        attention_head_dim=head_dim, num_attention_heads=num_heads,
                                        joint_attention_dim=32, caption_projection_dim=num_heads * head_dim,
                                        pooled_projection_dim=64, out_channels=4,
                                        pos_embed_max_size=64)
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
                        latent_channels=4, norm_num_groups=4, sample_size=2 * sample_size, shift_factor=0.06,
                        scaling_factor=1.5)
    encoders, tokenizers = [], []
    for _ in range(2):
        special = ["<pad>", "<unk>", "<|startoftext|>", "<|endoftext|>"]
        tokenizer = word_tokenizer(special, max_length=77) if text == "shapes" else \
            byte_tokenizer([special[0], *special[2:]], max_length=77)
        tokenizer.bos_token, tokenizer.eos_token = "<|startoftext|>", "<|endoftext|>"
        tokenizers.append(tokenizer)
        encoders.append(CLIPTextModelWithProjection(CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, max_position_embeddings=77, projection_dim=32, hidden_act="gelu",
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id)))
    StableDiffusion3Pipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=vae,
                             text_encoder=encoders[0], tokenizer=tokenizers[0], text_encoder_2=encoders[1],
                             tokenizer_2=tokenizers[1], text_encoder_3=None, tokenizer_3=None).save_pretrained(out)
    return Path(out)


@register_tiny("qwen2")
def tiny_text_lm(out: Path) -> Path:
    """`tiny:qwen2`: the tiny LM over bytes, for any prompt file."""
    return tiny_causal_lm(out, text="bytes")


@register_tiny("sd3")
def tiny_text_sd3(out: Path) -> Path:
    """`tiny:sd3`: the tiny SD3 pipeline over bytes, for any prompt file."""
    return tiny_sd3(out, text="bytes")


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/tiny-hf")
    print(tiny_causal_lm(root / "qwen2"), tiny_sd3(root / "sd3"))
