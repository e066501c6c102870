"""The tokenizer of the tiny random models (common/tiny.py's `tiny:<kind>`): bytes, so that they read
any prompt file."""
from __future__ import annotations


def byte_tokenizer(special: list[str], max_length: int | None = None):
    """A byte-level fast tokenizer (BPE over the 256 bytes, no merges) with `special` as whole
    tokens (the first is padding): it reads and writes any UTF-8 text, so tiny models built with it
    work on real prompt files, not only on the shapes words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(special)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    backend = Tokenizer(models.BPE(vocab, [], unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=special[0],
                                        model_max_length=max_length or 512)
    tokenizer.add_special_tokens({"additional_special_tokens": special[1:]})
    return tokenizer
