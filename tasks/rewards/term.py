"""One reward term's config section (`reward.terms.<name>`) and the scorer it builds.

Keys beyond `fn`, `weight`, `actors`, `resources`, `images_per_call`, `runtime_env` and `per_frame` are the scorer's options: a
built-in declares them in its `Options` (unknown keys are config errors, named with the term); a
user's class may declare them the same way; a plain function takes none. Two batch sizes meet
here: `images_per_call` is how many images a rollout worker sends one of the term's reward actors
per call (the shell's concern), a built-in's `batch_size` how many of them its model takes per
forward pass (the scorer's: a call of 64 images at `batch_size` 16 is four passes).

What a term looks at is declared by its scorer's `takes` (tasks/rewards/base.py): "images" (an
image term: on a video task it needs `per_frame`, tasks/rewards/frames.py), "clips" (a video term:
a video task only), or nothing (a text term, or a user's code that does not say: it receives what
the task makes).
"""
from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, NonNegativeFloat, NonNegativeInt, PositiveInt, ValidationError, model_validator

from common.config import Resources, Strict
from common.hub import asked_models
from common.loading import ModelLoadError, load_error, out_of_memory
from tasks.rewards import BUILTINS, is_model, resolve
from tasks.rewards.frames import PerFrame, PerFrameConfig


class TermConfig(Strict):
    """A named reward term: what scores it, its weight in the total, and where it is scored."""
    model_config = ConfigDict(extra="allow", validate_assignment=True)
    fn: str = Field(description="a built-in's short name (clip_score, pickscore, aesthetic, geneval, ocr, "
                                "vqa_score, temporal_consistency, format, length, faithful, shapes_*) or "
                                "package.module:function")
    weight: NonNegativeFloat = Field(1.0, description="the term's weight in the total reward")
    actors: NonNegativeInt | None = Field(None, description="K > 0: a pool of K reward actors scores this term "
                                                            "(its model loaded once per actor); 0: each rollout "
                                                            "worker scores it; None: `reward.actors`")
    resources: Resources | None = Field(None, description="what each of this term's reward actors reserves; "
                                                          "None: `reward.resources`")
    images_per_call: PositiveInt | None = Field(None, description="images a rollout worker sends one of this "
                                                "term's reward actors per call: a batch goes in calls of this "
                                                "many, to the pool's actors in turn and at once (each scorer "
                                                "then runs a call in forward passes of its own `batch_size`); "
                                                "None: the whole batch in one call. Only for a term scored "
                                                "by reward actors")
    runtime_env: dict[str, Any] | None = Field(None, description="Ray's runtime_env for this term's reward "
                                               "actors (env_vars, working_dir, py_executable, pip, …), so a reward "
                                               "with dependencies of its own runs in its own environment; "
                                               "env_vars are added to those every actor is given. Only for a term "
                                               "scored by reward actors in ray mode")
    per_frame: PerFrameConfig | None = Field(None, description="a video task: score this image term on "
                                             "`frames` frames of each clip (evenly spaced, the first and last "
                                             "among them) and `reduce` them (mean|min) to one value per clip; "
                                             "None: the term scores what the task makes")

    @model_validator(mode="after")
    def _builtin_options(self):
        """A built-in's options are checked with the config (a user's code is checked by preflight)."""
        if self.fn in BUILTINS:
            self.options()
        return self

    @property
    def builtin(self) -> bool:
        return self.fn in BUILTINS

    def options(self):
        """The scorer's validated options (None for a plain function)."""
        found = resolve(self.fn)
        extra = dict(self.model_extra or {})
        if not is_model(found):
            if extra:
                raise ValueError(f"'{self.fn}' is a function and takes no options, got {sorted(extra)}")
            return None
        try:
            return found.Options.model_validate(extra)
        except ValidationError as e:
            raise ValueError("; ".join(": ".join(filter(None, (".".join(map(str, err["loc"])),
                                                              err["msg"].removeprefix("Value error, "))))
                                       for err in e.errors())) from None

    def needs_images(self) -> bool:
        """False for a text term (a refiner can own it by default); a user's function is assumed
        to look at images."""
        if not self.builtin:
            return True
        return bool(resolve(self.fn).needs_images)

    def takes(self) -> str | None:
        """What the scorer looks at: "images", "clips", or None (a text term, or a user's code that
        does not say: whatever the task makes)."""
        found = resolve(self.fn)
        if not getattr(found, "needs_images", True):
            return None
        return getattr(found, "takes", None)

    def sample_problems(self, key: str, num_frames: int | None) -> list[str]:
        """Why this term cannot score the samples of a task making clips of `num_frames` (None:
        images): an image term on clips without `per_frame`, a video term on images or on clips
        shorter than its `min_frames`, `per_frame` on images, on a term that takes no images or of
        more frames than a clip has."""
        takes, frames = self.takes(), f"1..{num_frames}" if num_frames else ""
        if self.per_frame is not None:
            if num_frames is None:
                return [f"{key}.per_frame: the task makes images (task.num_frames is not set); per_frame scores "
                        f"frames of clips: remove it, or set task.num_frames"]
            if takes == "clips" or not self.needs_images():
                return [f"{key}.per_frame: {self.fn} scores {'whole clips' if takes else 'text'}, not frames: "
                        f"remove per_frame"]
            if self.per_frame.frames > num_frames:
                return [f"{key}.per_frame.frames={self.per_frame.frames}: a clip has {num_frames} frames "
                        f"(task.num_frames); valid values are {frames}"]
            return []
        if takes == "images" and num_frames is not None:
            return [f"{key}: {self.fn} scores images and the task makes clips of {num_frames} frames "
                    f"(task.num_frames): set {key}.per_frame: {{frames: k, reduce: mean|min}} with k in {frames}"]
        if takes == "clips" and num_frames is None:
            return [f"{key}: {self.fn} scores clips and the task makes images (task.num_frames is not set): set "
                    f"task.num_frames, or use an image term"]
        if takes == "clips" and num_frames < (least := getattr(resolve(self.fn), "min_frames", 1)):
            return [f"{key}: {self.fn} scores clips of at least {least} frames; task.num_frames={num_frames}"]
        return []


def sample_scorer(term: TermConfig, scorer):
    """`scorer` (the term's own, `build_scorer`'s, or its pool of reward actors') as it scores the
    task's samples: under `per_frame`, called on the frames chosen of each clip, so that a pool is
    sent those frames only."""
    return scorer if term.per_frame is None else PerFrame(scorer, term.per_frame.frames, term.per_frame.reduce)


def build_scorer(term: TermConfig, device, name: str | None = None):
    """The callable that scores `term` (on images where it takes them: `sample_scorer` applies its
    `per_frame`): a class is constructed (its model loaded) here, once. Given
    the term's `name`, a failure to construct it (but running out of memory) is raised as a
    ModelLoadError naming the option of the model it was loading (`reward.terms.<name>.model`,
    `.processor`, `.clip_model`, …: the last one it asked for)."""
    found = resolve(term.fn)
    if not is_model(found):
        return found
    options = term.options()
    with asked_models() as asked:
        try:
            return found(options, device)
        except Exception as error:
            if name is None or out_of_memory(error) or isinstance(error, ModelLoadError):
                raise
            raise load_error(error, *blamed_model(found, options, f"reward.terms.{name}", asked)) from error


def blamed_model(found, options, key: str, asked: list[str]) -> tuple[str, str]:
    """(the option's key, the model) that a failed construction of scorer `found` is blamed on:
    of the models its options name, the last one it asked for, else the first; the term itself
    (its `fn`) when it names none."""
    refs = found.models(options) if hasattr(found, "models") else []
    last = asked[-1] if asked else None
    ref = next((r for r in refs if r.name == last), refs[0] if refs else None)
    return (f"{key}.{ref.option}", ref.name) if ref else (key, getattr(found, "__name__", str(found)))
