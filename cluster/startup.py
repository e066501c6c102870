"""An actor that cannot start, said in one paragraph: which actor, the config key to blame (where
one is) and the cause, not a chain of Ray tracebacks.

Ray keeps only the text of an exception raised in an actor's constructor (the caller gets an
ActorDiedError whose message holds the remote traceback), and that text travels on, nested, in
the errors of every actor that called the dead one. So a constructor decorated with
`reports_start` raises its failure as one marked line of JSON (`ActorStartFailed`), which survives
any nesting, and `start_failure` finds it again in whatever error reaches the caller. A failure is
the user's (exit 2) when a setting is to blame (common/config.py `SettingError`: a model that cannot
be loaded, a setting refused); anything else (running out of memory, a bug) exits 1.
"""
from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass

from common.config import SettingError
from common.loading import one_line, out_of_memory

MARK = "jointrl-start-failure:"


@dataclass(frozen=True)
class StartFailure:
    """Why an actor could not start: `actor` its name, `key` the config key to blame (None: no
    setting is), `cause` one line."""
    actor: str
    cause: str
    key: str | None = None

    @property
    def users(self) -> bool:
        """The user's to fix: a setting is to blame."""
        return self.key is not None

    @property
    def exit_code(self) -> int:
        return 2 if self.users else 1

    def paragraph(self, log: str | None = None) -> str:
        """The one paragraph the user reads (`log`: where the full traceback is)."""
        fix = f" Change {self.key} and start again." if self.users else ""
        where = f" The full traceback is in {log}." if log else ""
        return f"the run could not start: actor {self.actor} failed as it started: {self.cause}.{fix}{where}"

    @staticmethod
    def of(error: BaseException, actor: str) -> "StartFailure":
        """The failure of `actor` that `error` (raised as it started) says: the failure of another
        actor it carries (one this actor waited for), else its own."""
        if (carried := start_failure(error)) is not None:
            return carried
        cause = getattr(error, "cause", None) or error  # a Ray task error: the exception the remote call raised
        if out_of_memory(cause):
            return StartFailure(actor, f"out of memory ({one_line(cause)})")
        key = cause.config_key if isinstance(cause, SettingError) else None
        text = str(cause) if isinstance(cause, SettingError) else one_line(cause)
        return StartFailure(actor, " ".join(text.split()), key)


class ActorStartFailed(RuntimeError):
    """Raised by a constructor that failed: its message is the StartFailure as one marked JSON line."""

    def __init__(self, failure: StartFailure):
        super().__init__(MARK + json.dumps(asdict(failure)))
        self.failure = failure

    def __reduce__(self):
        return ActorStartFailed, (self.failure,)


def start_failure(error: BaseException) -> StartFailure | None:
    """The start-up failure `error` carries, if any: its own, or the first marked in its text (the
    innermost: a chained traceback prints its cause first)."""
    if isinstance(error, ActorStartFailed):
        return error.failure
    text = str(error)
    at = text.find(MARK)
    if at < 0:
        return None
    try:
        found, _ = json.JSONDecoder().raw_decode(text, at + len(MARK))
        return StartFailure(**found)
    except (ValueError, TypeError):
        return None


def actor_name(instance) -> str:
    """The Ray name of the actor `instance` is (`<run_name>/rollout/0`), or its class in-process."""
    import ray
    name = ray.get_runtime_context().get_actor_name() if ray.is_initialized() else None
    return name or type(instance).__name__


def reports_start(init):
    """Decorates an actor's `__init__`: whatever it raises is raised again as ActorStartFailed,
    naming the actor (the original error chained, for the log)."""
    @functools.wraps(init)
    def started(self, *args, **kwargs):
        try:
            init(self, *args, **kwargs)
        except Exception as error:
            raise ActorStartFailed(StartFailure.of(error, actor_name(self))) from error
    return started
