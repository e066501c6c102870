"""One code path, two modes: the same actor classes run as Ray actors or in-process (`inline`).

In-process handles mimic the part of Ray's actor API the project uses (`h.method.remote(...)`,
`.options(num_returns=k)`, ObjectRef arguments resolved at the top level) so that `inline` is the
correctness oracle for `ray` and a debugger can step through a whole training step.

Every Ray actor is given this process's Hugging Face client settings (HF_TOKEN, HF_HOME, … :
common/hub.py `hub_env`) in its runtime_env, so an actor on a node started by `ray start` reads the
hub with the client's token into the client's cache; the actors it spawns pass them on. An actor
that reserves a GPU is also given `GPU_ENV` (this process's own values where it sets them).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import os

import ray

from common.hub import hub_env

# Set in every actor that reserves a GPU, before torch starts CUDA or NCCL there.
GPU_ENV = {
    # segments that grow in place instead of new fixed-size blocks: a step's varying sequence and
    # batch shapes fragment the caching allocator's pool less (torch's CUDA memory notes).
    # PYTORCH_CUDA_ALLOC_CONF is read first by every torch the project supports (PYTORCH_ALLOC_CONF,
    # its newer generic name, is read only where the former is unset).
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    # 2, CleanUpOnly: on a failed or timed-out collective NCCL's watchdog aborts the communicator
    # and the waiting call raises ("NCCL communicator was aborted"), where torch's default (3,
    # SkipCleanUp) tears the process down. So a lost peer reaches experts/parallel.py's
    # recognition and the gang is rebuilt, instead of every rank dying and spending
    # cluster.max_restarts (torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp: ErrorHandlingMode).
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
}


def actor_env(options: dict) -> dict[str, str]:
    """The environment variables a Ray actor spawned with `options` is given: the hub's settings,
    this process's own values of GPU_ENV's variables (so the driver actor passes a user's choice on
    to the actors it spawns), and GPU_ENV's defaults for the rest if the actor reserves a GPU."""
    own = {k: os.environ[k] for k in GPU_ENV if k in os.environ}
    return {**hub_env(), **({**GPU_ENV, **own} if options.get("num_gpus") else own)}


class InlineRef:
    """An already-computed result standing in for an ObjectRef."""

    def __init__(self, value):
        self.value = value


def _resolve(arg):
    return arg.value if isinstance(arg, InlineRef) else arg


class _InlineMethod:
    def __init__(self, fn, num_returns: int = 1):
        self.fn, self.num_returns = fn, num_returns

    def options(self, num_returns: int = 1, **_ignored) -> "_InlineMethod":
        return _InlineMethod(self.fn, num_returns)

    def remote(self, *args, **kwargs):
        out = self.fn(*map(_resolve, args), **{k: _resolve(v) for k, v in kwargs.items()})
        return tuple(InlineRef(o) for o in out) if self.num_returns > 1 else InlineRef(out)


class InlineHandle:
    def __init__(self, instance):
        self.instance = instance

    def __getattr__(self, name):
        return _InlineMethod(getattr(self.instance, name))


def get(refs):
    """`ray.get` for ObjectRefs, InlineRefs, or a list or dict of either."""
    if isinstance(refs, dict):
        return dict(zip(refs, get(list(refs.values()))))
    if isinstance(refs, list):
        if all(isinstance(r, InlineRef) for r in refs):
            return [r.value for r in refs]
        return ray.get(refs)
    return refs.value if isinstance(refs, InlineRef) else ray.get(refs)


@dataclass
class Members:
    """A run's actors by name: `<run_name>/<name>` in Ray's `jointrl` namespace, or the in-process
    handles of an inline run. An actor that talks to other actors is given their names and looks
    them up, not their handles: Ray keeps handles given to a constructor in its object store, where
    a restarted actor may not find them (and says so in an error line when the actor is made)."""
    run_name: str
    inline: dict[str, InlineHandle] | None = field(default=None, compare=False)

    def __call__(self, name: str):
        if self.inline is not None:
            return self.inline[name]
        return ray.get_actor(f"{self.run_name}/{name}", namespace="jointrl")


class Runtime:
    """Spawns actors for a mode: `ray` (named, in the `jointrl` namespace) or `inline`."""

    def __init__(self, mode: str, run_name: str, max_restarts: int = 0, placement=None):
        """`max_restarts` and `placement` (cluster/placement.py) apply to the run's members (`spawn_member`)."""
        self.mode, self.run_name, self.max_restarts, self.placement = mode, run_name, max_restarts, placement
        self.members = Members(run_name, {} if mode == "inline" else None)

    def put(self, value):
        """`value` in the object store (ray) or wrapped as an already-computed result (inline)."""
        return InlineRef(value) if self.mode == "inline" else ray.put(value)

    def spawn(self, cls, *args, name: str, **options):
        if self.mode == "inline":
            handle = self.members.inline[name] = InlineHandle(cls(*args))
            return handle
        options = {"num_cpus": 0, **options}
        own = options.pop("runtime_env", None) or {}  # a reward term's own (reward.terms.<name>.runtime_env)
        if (env := {**actor_env(options), **own.get("env_vars", {})}) or own:
            options["runtime_env"] = {**own, **({"env_vars": env} if env else {})}
        groups = getattr(cls, "CONCURRENCY_GROUPS", None)  # its methods' groups besides the default one
        actor = ray.remote(concurrency_groups=groups)(cls) if groups else ray.remote(cls)
        return actor.options(name=f"{self.run_name}/{name}", namespace="jointrl", **options).remote(*args)

    def spawn_member(self, cls, *args, name: str, resources=None, runtime_env: dict | None = None):
        """An actor of the run: Ray restarts it when it dies (its state is restored by whoever holds
        it), it reserves `resources`, and it runs in its placement bundle if it reserved one, in
        `runtime_env` besides the environment every actor is given."""
        options = {**(resources.options() if resources else {}),  # the placement's share of a GPU overrides the ask
                   **(self.placement.options.get(name, {}) if self.placement else {}),
                   **({"runtime_env": runtime_env} if runtime_env else {})}
        return self.spawn(cls, *args, name=name, max_restarts=self.max_restarts, max_task_retries=0, **options)
