"""What a rollout worker holds around the generator, one kind per generator model: the text side
(composing a prompt with its refinements and encoding it, with a cache), the space the flow runs
in (its shape, its sigma schedule) and the way back to pixels.

`ShapesFrontEnd` serves the tiny DiT: its own frozen text encoder over the task's words (the shapes
vocabulary, with the motion words under shapes_video), pixel space, evenly spaced sigmas; a clip's
flow state is (3, F, H, W), decoded to frames (F, 3, H, W). A diffusers generator brings its
family's (experts/families.py).
"""
from __future__ import annotations

import torch

from experts.build import seeded_model
from algorithm.sde import sigma_schedule
from experts.text_encoder import CachedEncoder, TextEncoder
from tasks import text_vocabulary


def build_text_encoder(config, fresh: bool = False) -> TextEncoder:
    """The tiny DiT's frozen text encoder over the task's words: seeded, then at its `init` if
    given, unless `fresh`."""
    te, vocab = config.experts.text_encoder, text_vocabulary(config.task)
    return seeded_model(config, "text_encoder", lambda: TextEncoder(vocab, te.d_model, te.n_layers, te.n_heads,
                                                                    max_len=te.max_sequence_length),
                        None if fresh else te.init)


class ShapesFrontEnd:
    def __init__(self, config, device: torch.device):
        self.config = config
        self.encoder = CachedEncoder(build_text_encoder(config).to(device), int(config.rollout.text_cache_mb * 2 ** 20),
                                     version=0)
        size, frames = config.task.image_size, config.task.num_frames
        self.latent_shape = (3, size, size) if frames is None else (3, frames, size, size)
        self.vocab = text_vocabulary(config.task)

    @property
    def version(self) -> int:
        return self.encoder.version

    def condition(self, prompts: list, refinements: list[dict], drop: str | None = None) -> dict[str, torch.Tensor]:
        """The encoder's features of <bos> prompt, then <sep> y_k for each refiner (except `drop`),
        the prompt's and each refinement's words in the encoder's vocabulary (it cannot read others),
        cut at the encoder's `max_sequence_length` (tasks.base.Vocabulary.compose); under
        task.compose=replace the refinements alone, where any was written."""
        order, vocab = self.config.experts.active_refiners(), self.vocab
        seqs = [vocab.compose(vocab.encode(p.text.split(), vocab.max_prompt_words),
                              [vocab.encode(refs[e].words, self.config.expert(e).max_new_tokens)
                               for e in order if e in refs and e != drop],
                              self.config.experts.text_encoder.max_sequence_length,
                              replace=self.config.task.compose == "replace")
                for p, refs in zip(prompts, refinements)]
        text, text_pad = self.encoder(seqs)
        return {"text": text, "text_pad": text_pad}

    def sigmas(self, steps: int) -> torch.Tensor:
        return sigma_schedule(steps)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images (B, 3, H, W) or clips (B, F, 3, H, W) in [-1, 1]: the flow runs in pixel space."""
        return latents.clamp(-1, 1) if latents.dim() == 4 else latents.clamp(-1, 1).transpose(1, 2)

    def take_stats(self) -> tuple[int, int]:
        return self.encoder.take_stats()


def build_frontend(config, device: torch.device = torch.device("cpu")):
    if config.experts.generator.model.kind == "diffusers_flow":
        from common.hub import local_model
        from common.loading import loading_model
        from experts.families import family_module
        m = config.experts.generator.model
        with loading_model("experts.generator.model.path", m.path):
            return family_module(local_model(m.path, m.revision)).FrontEnd(config, device)
    return ShapesFrontEnd(config, device)
