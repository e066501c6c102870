"""`jointrl download`: every hub model a config names, fetched into the Hugging Face cache before a
run (common/hub.py `fetch`, the same fetch the actors make), so that a GPU job starts by reading
its cache. `--list` prints the models and an `hf download` line for each instead.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.hub import MODEL_FILES, ModelRef


@dataclass(frozen=True)
class HubModel:
    """A hub model a config names: the key that names it, what it is, whether it is a diffusers pipeline."""
    key: str
    model: ModelRef
    pipeline: bool = False

    def hf_command(self) -> str:
        """The `hf download` line fetching what loading reads (a superset for a pipeline: every
        component folder, without a repo's single-file checkpoints)."""
        revision = f" --revision {self.model.revision}" if self.model.revision else ""
        files = ["model_index.json", "*/*"] if self.pipeline else \
            [*MODEL_FILES, *(["*.safetensors"] if self.model.weights else [])]
        return f"hf download {self.model.name}{revision} --include " + " ".join(f'"{f}"' for f in files)

    def __str__(self) -> str:
        return (f"{self.model.name}@{self.model.revision or 'default branch'}"
                f"{'' if self.model.weights else ' (no weights)'} ({self.key})")


def hub_models(config) -> list[HubModel]:
    """Every model of the run's experts and reward terms that is a hub id (not a local folder, not
    `tiny:`), once each, with the first key that names it (`experts.<id>.model.path`,
    `reward.terms.<name>.<option>`)."""
    named = []
    for eid in config.experts.ids():
        m = config.expert(eid).model
        if m.kind in ("hf_causal_lm", "diffusers_flow"):
            named.append(HubModel(f"experts.{eid}.model.path", ModelRef(m.path, m.revision),
                                  pipeline=m.kind == "diffusers_flow"))
    for name, term in config.reward.terms.items():
        named += term_models(name, term)
    first: dict[ModelRef, HubModel] = {}
    for n in named:
        if n.model.on_hub:
            first.setdefault(n.model, n)
    return list(first.values())


def term_models(name: str, term) -> list[HubModel]:
    """The models reward term `name` loads, each with the key of the option that names it."""
    from tasks.rewards import resolve
    options = term.options()
    models = getattr(resolve(term.fn), "models", None)
    if options is None or models is None:
        return []
    return [HubModel(f"reward.terms.{name}.{model.option}", model) for model in models(options)]


def download(config, on_model=print) -> list[str]:
    """Fetch every hub model of `config`; returns the failures, one line each (the others are
    fetched all the same)."""
    from common.hub import fetch
    failed = []
    for hub_model in hub_models(config):
        m = hub_model.model
        try:
            on_model(f"{hub_model}: {fetch(m.name, m.revision, m.weights)}")
        except Exception as e:  # the hub client's errors: not found, gated, offline, network, disk
            failed.append(f"{hub_model}: {type(e).__name__}: {e}")
    return failed
