"""`fn: http`: a reward term scored by a server elsewhere (`jointrl serve-reward`, or anyone's that
speaks the protocol below), so a reward with dependencies of its own runs in its own environment or
on another machine.

The protocol, JSON in and out (no pickle), one POST per batch of at most `batch_size` samples:

    POST <url>/score   Authorization: Bearer <token>   (where the server asks for one)
    {"images": [[<PNG, base64>, ...], ...],            one list per sample: its image, or its clip's frames
     "prompts": [{"text": str, "metadata": {...}}, ...],
     "refinements": [{"<refiner id>": {"text": str, "ended": bool, "formatted": bool|null}, ...}, ...]}
    -> 200 {"scores": [float|null, ...]}               one per sample, null where it cannot score it
    -> 400 {"error": "<one line>"}                     a request that is not the protocol
    POST <url>/strict  the same body -> 200 {"strict": [0|1|null, ...]}   where the term has a strict
                       correctness (GenEval's: every clause holds), for `jointrl eval`
    GET <url>/health -> 200 {"term": str, "fn": str, "strict": bool}

Images travel as 8-bit RGB PNGs, as reward models read them (a term reading the generator's float
values sees them rounded to the 8-bit value, taken at the middle of its bin). Refinements are
those of the refiners that own the term (all of them where none does), {} for a sample not refined.

A batch that fails (no answer within `timeout_s`, a refused connection, an HTTP error) is sent again
up to `retries` times, then raises; the run's reward guard (tasks/reward_guard.py) then scores the
batch sample by sample and counts what still fails, as for every term. A score of null is NaN
(counted and dropped by the guard).
"""
from __future__ import annotations

import base64
import io
import json
import os
import time
import urllib.error
import urllib.request
from typing import Any, Sequence

import numpy as np
from pydantic import Field, PositiveFloat

from tasks.base import Refinement, from_uint8, to_uint8
from tasks.rewards.base import Options, RewardModel

TOKEN_ENV = "JOINTRL_REWARD_TOKEN"


class HttpOptions(Options):
    url: str = Field(description="the reward server's address, e.g. http://10.0.0.5:8700 (POST <url>/score)")
    timeout_s: PositiveFloat = Field(60.0, description="seconds one batch may take to be answered")
    retries: int = Field(2, ge=0, description="times a failed batch is sent again before the term raises")
    token_env: str = Field(TOKEN_ENV, description="the environment variable holding the bearer token the server "
                                                  "asks for (never the token itself: a config is saved with the run)")


def png(sample: np.ndarray) -> list[str]:
    """An image (3, H, W) or a clip (F, 3, H, W) in [-1, 1] as base64 PNGs, one per frame."""
    from PIL import Image
    frames = to_uint8(sample)
    frames = frames[None] if frames.ndim == 3 else frames
    out = []
    for frame in frames:
        buffer = io.BytesIO()
        Image.fromarray(frame).save(buffer, format="PNG", compress_level=1)  # fast: pixels seldom compress much
        out.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
    return out


def unpng(frames: list[str]) -> np.ndarray:
    """A sample's base64 PNGs as the generator's (3, H, W), or (F, 3, H, W) for several frames, in
    [-1, 1] (`from_uint8`)."""
    from PIL import Image
    decoded = [np.asarray(Image.open(io.BytesIO(base64.b64decode(f, validate=True))).convert("RGB")) for f in frames]
    values = from_uint8(np.stack(decoded))
    return values[0] if len(values) == 1 else values


def request_body(images: np.ndarray | None, prompts: Sequence[Any], refinements: Sequence[dict]) -> dict:
    return {"images": [png(s) for s in images] if images is not None else [],
            "prompts": [{"text": p.text, "metadata": dict(p.metadata)} for p in prompts],
            "refinements": [{e: {"text": r.text, "ended": r.ended, "formatted": r.formatted} for e, r in refs.items()}
                            for refs in refinements]}


def read_body(body: dict) -> tuple[np.ndarray | None, list, list[dict[str, Refinement]]]:
    """(images, prompts, refinements) of a request; ValueError saying what is not the protocol."""
    from tasks.prompt_data import DataPrompt
    if not isinstance(body, dict) or not isinstance(body.get("prompts"), list):
        raise ValueError("the body must be a JSON object with a list 'prompts'")
    n = len(body["prompts"])
    images, refinements = body.get("images", []), body.get("refinements", [{}] * n)
    if not isinstance(images, list) or images and len(images) != n or not isinstance(refinements, list) \
            or len(refinements) != n:
        raise ValueError(f"'images' and 'refinements' must be lists of one entry per prompt ({n})")
    try:
        prompts = [DataPrompt(str(p["text"]), dict(p.get("metadata") or {})) for p in body["prompts"]]
        refs = [{e: Refinement(str(r["text"]), bool(r["ended"]), r.get("formatted")) for e, r in s.items()}
                for s in refinements]
        decoded = np.stack([unpng(s) for s in images]) if images else None
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"a prompt or refinement lacks {e}") from None
    except (OSError, ValueError) as e:  # not base64, not an image, or images of different sizes
        raise ValueError(f"'images' must hold base64 PNGs of one size ({type(e).__name__}: {e})") from None
    return decoded, prompts, refs


class HttpReward(RewardModel):
    """A term scored by the reward server at `url`; with a strict correctness (`strict`, for `jointrl
    eval`) where the server's term has one (its /health says so), else `strict` is None."""
    Options = HttpOptions

    def __init__(self, options: HttpOptions, device):
        super().__init__(options, device)
        try:
            has_strict = bool(health(options).get("strict"))
        except (OSError, ValueError, AttributeError):  # not answering now: scoring retries, and is counted
            has_strict = False
        self.strict = self.strict_scores if has_strict else None

    def __call__(self, images: np.ndarray, prompts: Sequence[Any],
                 refinements: Sequence[dict[str, Refinement]]) -> np.ndarray:
        return self.ask("score", images, prompts, refinements)

    def strict_scores(self, images: np.ndarray, prompts: Sequence[Any],
                      refinements: Sequence[dict[str, Refinement]]) -> np.ndarray:
        return self.ask("strict", images, prompts, refinements)

    def ask(self, what: str, images, prompts, refinements) -> np.ndarray:
        """POST <url>/<what> ("score" or "strict") in batches: one value per sample."""
        out = np.empty(len(prompts))
        for rows in self.batches(len(prompts)):
            body = request_body(None if images is None else images[rows], prompts[rows], refinements[rows])
            out[rows] = self.values(what, body, rows.stop - rows.start)
        return out

    def values(self, what: str, body: dict, n: int) -> np.ndarray:
        data = json.dumps(body).encode()
        for attempt in range(self.options.retries + 1):
            try:
                answer = post(self.options.url, what, data, self.options.timeout_s,
                              token=os.environ.get(self.options.token_env))
                break
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                if isinstance(e, urllib.error.HTTPError) and e.code < 500 or attempt == self.options.retries:
                    raise RuntimeError(f"the reward server at {self.options.url}: {describe(e)}") from None
                time.sleep(0.5 * (attempt + 1))
        key = "scores" if what == "score" else what
        scores = answer.get(key) if isinstance(answer, dict) else None
        if not isinstance(scores, list) or len(scores) != n \
                or not all(s is None or isinstance(s, (int, float)) and not isinstance(s, bool) for s in scores):
            raise ValueError(f"the reward server at {self.options.url} answered {str(answer)[:120]!r}, not "
                             f"{{\"{key}\": [{n} numbers or null]}}")
        return np.array([np.nan if s is None else s for s in scores], dtype=np.float64)


def post(url: str, what: str, data: bytes, timeout_s: float, *, token: str | None) -> Any:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(f"{url.rstrip('/')}/{what}", data=data, headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        raw = response.read()
    try:
        return json.loads(raw)
    except ValueError:
        return raw[:120].decode(errors="replace")


def describe(error: Exception) -> str:
    if isinstance(error, urllib.error.HTTPError):
        try:
            reason = json.loads(error.read()).get("error", "")
        except (ValueError, AttributeError, OSError):
            reason = ""
        return f"HTTP {error.code}{': ' + reason if reason else ''}"
    return f"{type(error).__name__}: {getattr(error, 'reason', error)}"


def health(options: HttpOptions) -> dict:
    """The term's server's GET /health answer, within 5 s (or the term's `timeout_s` if shorter);
    raises what reaching it raised."""
    token = os.environ.get(options.token_env)
    request = urllib.request.Request(options.url.rstrip("/") + "/health",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=min(5.0, options.timeout_s)) as response:
        return json.loads(response.read())
