"""The reward library: built-in terms by short name, and a user's own `package.module:function`.

Each built-in is a `RewardModel` class (tasks/rewards/base.py) imported only when a config names
it, so a run that uses none of them imports no `transformers`. Importing the package registers the
tiny reward models' builders (tasks/rewards/tiny/).
"""
from __future__ import annotations

import importlib
import inspect

from tasks.rewards import tiny  # noqa: F401

BUILTINS = {
    "clip_score": "tasks.rewards.clip:ClipScore",
    "pickscore": "tasks.rewards.clip:PickScore",
    "aesthetic": "tasks.rewards.aesthetic:Aesthetic",
    "geneval": "tasks.rewards.geneval:GenEval",
    "ocr": "tasks.rewards.ocr:OCR",
    "vqa_score": "tasks.rewards.vqa:VQAScore",
    "format": "tasks.rewards.text:Format",
    "length": "tasks.rewards.text:Length",
    "faithful": "tasks.rewards.text:Faithful",
    "temporal_consistency": "tasks.rewards.temporal:TemporalConsistency",
    "http": "tasks.rewards.http:HttpReward",
    "shapes_image": "tasks.rewards.shapes:ShapesImage",
    "shapes_fidelity": "tasks.rewards.shapes:ShapesFidelity",
    "shapes_style": "tasks.rewards.shapes:ShapesStyle",
    "shapes_format": "tasks.rewards.shapes:ShapesFormat",
    "shapes_video": "tasks.rewards.shapes:ShapesVideo",
}


def resolve(fn: str):
    """The class or function a term's `fn` names: a built-in's short name or `package.module:function`."""
    spec = BUILTINS.get(fn, fn)
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ValueError(f"'{fn}' is neither a built-in reward ({', '.join(BUILTINS)}) nor of the form "
                         f"package.module:function")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import the reward '{fn}': {type(e).__name__}: {e}") from None
    if not callable(found):
        raise ValueError(f"the reward '{fn}' is not callable")
    return found


def is_model(found) -> bool:
    """Whether `found` is constructed once and then called (a class), or called as it is."""
    return inspect.isclass(found)
