"""`random:<name>`: a real architecture with random weights, built here and saved as its checkpoint
is laid out, so that a run at real scale (memory, token counts, kernels) needs no hub.

`<name>` is found as `jointrl plan` finds it (common/architectures.py: a local folder of config
files, the Hugging Face cache, or the architectures shipped in configs/architectures/), so a
`random:` model is planned exactly as the real one. Each module is built from its config with its
parameters on the meta device (its buffers, such as SD3's positional table or a rotary embedding's
frequencies, computed as usual), then every parameter is materialised in bfloat16 and filled in one
pass per tensor (no per-element Python initialisation of billions of weights): matrices, kernels
and embeddings uniform in +-1/sqrt(fan_in), so activations stay of order one through the blocks
(SD3.5-medium's velocity, text features and decoded pixels come out with standard deviations of
0.3 to 0.6, all finite, in bfloat16); a norm's and any other vector's weight 1, biases 0. The checkpoint is bfloat16 (as
the presets' real ones); a loader casts it to the config's dtype as it would a real one.

A pipeline (model_index.json) gets every component with weights, its scheduler (the shipped
`scheduler/scheduler_config.json` where there is one, else the class's defaults) and a stand-in
tokenizer per text encoder; a transformers model (config.json) its weights and a stand-in tokenizer.
The real tokenizer files are not shipped, so a stand-in has the encoder's vocabulary size and its
special tokens at the ids its config names, and splits text into words and punctuation (about as
many tokens as a real BPE tokenizer makes of English; each unknown word is one `<unk>`): CLIP's
wraps a text in its start and end tokens and stops at 77, T5's ends it with `</s>`, a causal LM's
speaks ChatML (`<|im_start|>role ... <|im_end|>`, the end token its end of sequence) and counts each
newline as a token, as Qwen's byte-level BPE does (so the 34 tokens Qwen-Image's pipeline drops
from the front of its prompt template are the template's system turn here too).

Builds go to `<tiny cache>/random/<name>-<digest of the config files>`, one process per node under a
file lock (the others wait and read the same files), renamed into place when complete.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

from common.architectures import config_folder, weighted_components
from common.tiny import cache_root

VERSION = "v1"  # bump when what a build writes changes
DTYPE = torch.bfloat16
CHATML_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def random_model(name: str, revision: str | None = None) -> Path:
    """The folder of `random:<name>`, built first if not cached (see the module docstring)."""
    source = config_folder(name, revision)
    digest = config_digest(source)
    local = Path(name).expanduser()
    label = local.resolve().name if local.is_dir() else name.replace("/", "--")  # a folder's name, or org--name
    out = cache_root() / "random" / f"{label}-{digest}"
    if out.is_dir():
        return out
    from filelock import FileLock
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if out.is_dir():  # another process of this node built it while this one waited
            return out
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        try:
            build(source, tmp, seed=int(digest, 16))
            os.rename(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def config_digest(source: Path) -> str:
    """What a build depends on: the builder's version and every config file of the model."""
    h = hashlib.sha256(VERSION.encode())
    for f in sorted(source.rglob("*.json")):
        h.update(str(f.relative_to(source)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:12]


def build(source: Path, out: Path, seed: int = 0) -> Path:
    """Write the random model of the config files in `source` to `out`."""
    if (source / "model_index.json").is_file():
        return build_pipeline(source, out, seed)
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(source)
    cls = (config.architectures or [None])[0]
    if cls is None:
        raise ValueError(f"random: {source}/config.json names no architecture (its `architectures` list)")
    save_random(source, "transformers", cls, out, seed)
    stand_in_tokenizer(config).save_pretrained(out)
    return out


def build_pipeline(source: Path, out: Path, seed: int) -> Path:
    """A diffusers pipeline: its weighted components, scheduler and stand-in tokenizers, and its
    model_index.json naming the classes written."""
    index = json.loads((source / "model_index.json").read_text())
    weighted = weighted_components(source)
    written = dict(index)
    for k, (name, spec) in enumerate(index.items()):
        if not isinstance(spec, list) or spec[0] is None:
            continue
        library, cls = spec
        if name in weighted:
            save_random(source / name, library, cls, out / name, seed + k * 2 ** 20)  # each component its own generators
        elif name.startswith("scheduler"):
            found = getattr(importlib.import_module(library), cls)
            shipped = source / name / "scheduler_config.json"
            (found.from_config(found.load_config(source / name)) if shipped.is_file() else found()).save_pretrained(out / name)
        elif name.startswith("tokenizer"):
            from transformers import AutoConfig
            encoder = source / ("text_encoder" + name[len("tokenizer"):])
            tokenizer = stand_in_tokenizer(AutoConfig.from_pretrained(encoder))
            tokenizer.save_pretrained(out / name)
            written[name] = ["transformers", type(tokenizer).__name__]
        else:
            raise ValueError(f"random: no stand-in for the component '{name}' ({library}.{cls}) of {source}")
    (out / "model_index.json").write_text(json.dumps(written, indent=2))
    return out


def save_random(folder: Path, library: str, cls: str, out: Path, seed: int) -> None:
    """The module `library.cls` of the config in `folder` with random weights, saved to `out` as
    the library saves it (and freed before the next one is built)."""
    from accelerate import init_empty_weights
    found = getattr(importlib.import_module(library), cls)
    with init_empty_weights(include_buffers=False):
        if library == "diffusers":
            module = found.from_config(found.load_config(folder))
        else:
            from transformers import AutoConfig
            module = found._from_config(AutoConfig.from_pretrained(folder))
    materialise(module, seed)
    module.save_pretrained(out)


@torch.no_grad()
def materialise(module: nn.Module, seed: int) -> nn.Module:
    """Every meta parameter of `module` made real in DTYPE and filled (module docstring), tensors
    filled in parallel threads (PyTorch fills one tensor on one core), each from its own generator
    so that the weights do not depend on the threads; floating buffers cast to DTYPE; a transformers
    model's tied parameters tied again (building them on the meta device unties them)."""
    made: dict[int, tuple[nn.Parameter, bool]] = {}  # id of the meta parameter -> (its real one, a bias)
    for owner in module.modules():
        for name, p in list(owner._parameters.items()):
            if p is None:
                continue
            if id(p) not in made:
                real = torch.empty(p.shape, dtype=DTYPE if p.is_floating_point() else p.dtype)
                made[id(p)] = (nn.Parameter(real, requires_grad=p.requires_grad), "bias" in name)
            owner._parameters[name] = made[id(p)][0]

    def fill(i: int, t: torch.Tensor, bias: bool):
        if t.dim() >= 2:
            bound = t[0].numel() ** -0.5
            t.uniform_(-bound, bound, generator=torch.Generator().manual_seed((seed + i) % 2 ** 63))
        else:
            t.fill_(0.0 if bias else 1.0)

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(lambda i, made: fill(i, made[0].data, made[1]), range(len(made)), made.values()))
    for owner in module.modules():
        for name, b in list(owner._buffers.items()):
            if b is not None and b.is_floating_point():
                owner._buffers[name] = b.to(DTYPE)
    if hasattr(module, "tie_weights"):
        module.tie_weights()
    return module


# --- stand-in tokenizers ------------------------------------------------------------------------------


def stand_in_tokenizer(config):
    """A tokenizer for the text model of `config` (a transformers config): its vocabulary size, its
    special tokens at the ids the config names, words and punctuation as tokens (module docstring)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    text = config.get_text_config()
    size, kind = text.vocab_size, config.model_type
    ids = lambda key: getattr(text, key, None)  # noqa: E731 (T5's config has no bos_token_id at all)
    if "clip" in kind or "owlv" in kind:
        style = "clip"
        wanted = {"<|startoftext|>": ids("bos_token_id"), "<|endoftext|>": ids("eos_token_id")}
        roles = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    elif kind in ("t5", "mt5", "umt5"):
        style = "t5"
        wanted = {"<pad>": ids("pad_token_id"), "</s>": ids("eos_token_id")}
        roles = {"pad_token": "<pad>", "eos_token": "</s>"}
    else:
        style = "chat"
        eos = ids("eos_token_id")
        wanted = {"<|im_end|>": eos[0] if isinstance(eos, list) else eos, "<|endoftext|>": ids("pad_token_id"),
                  "<|im_start|>": None}
        roles = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    wanted["<unk>"] = None
    special = place_specials(wanted, size)
    vocab = {f"w{i}": i for i in range(size)}
    vocab = {**{k: v for k, v in vocab.items() if v not in special.values()}, **special}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # words and runs of punctuation; a chat model's newlines are tokens too, as in a byte-level BPE
    pieces = r"\w+|[^\w\s]+" + (r"|\n" if style == "chat" else "")
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(pieces), behavior="removed", invert=True)
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    if style == "clip":
        backend.post_processor = processors.TemplateProcessing(
            single="<|startoftext|> $A <|endoftext|>",
            special_tokens=[(t, special[t]) for t in ("<|startoftext|>", "<|endoftext|>")])
    elif style == "t5":
        backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", special["</s>"])])
    longest = 77 if style == "clip" else 512 if style == "t5" else getattr(text, "max_position_embeddings", None) or 2048
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", model_max_length=longest, **roles)
    tokenizer.add_special_tokens({"additional_special_tokens": [t for t in special if t not in roles.values()
                                                                and t != "<unk>"]})
    if style == "chat":
        tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def place_specials(wanted: dict[str, int | None], size: int) -> dict[str, int]:
    """Each special token at the id its config names (if any and free), the others on the highest
    free ids (`<unk>` on the lowest)."""
    placed: dict[str, int] = {}
    for token, i in wanted.items():
        if isinstance(i, int) and 0 <= i < size and i not in placed.values():
            placed[token] = i
    free_low = (i for i in range(size) if i not in placed.values())
    free_high = (i for i in range(size - 1, -1, -1) if i not in placed.values())
    for token in wanted:
        if token not in placed:
            placed[token] = next(free_low) if token == "<unk>" else next(free_high)
    if len(set(placed.values())) != len(placed):
        raise ValueError(f"random: a vocabulary of {size} has no room for the special tokens {list(wanted)}")
    return placed

