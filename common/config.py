"""The config base every section shares, and the Ray resources an actor reserves.

Pure: it imports neither the driver, the cluster nor Ray, and checks nothing outside the values
themselves (files, models and packages are checked by driver/preflight.py).
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat


class SettingError(ValueError):
    """A bad setting, the user's to fix: a config or value the schema, an override or a preflight
    check refuses, or a failure found only where the setting is used (an actor loading a model,
    forming a group). The CLI prints it and exits with status 2, before starting anything where it
    can. `config_key` names the key where one is to blame."""
    config_key: str | None = None


class Strict(BaseModel):
    """A config section: unknown keys are errors, and assignments are validated too."""
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Resources(Strict):
    """What one actor reserves from Ray; `custom` names resources a node advertises (e.g. a pool)."""
    num_cpus: NonNegativeFloat = Field(0.0, description="CPUs the actor reserves (fractions share a CPU)")
    num_gpus: NonNegativeFloat = Field(0.0, description="GPUs the actor reserves (fractions share a GPU); "
                                                        "> 0 also places its model on the GPU. On a cluster with "
                                                        "GPUs the memory plan (`jointrl plan`) decides which GPU "
                                                        "and the actor's share of it")
    custom: dict[str, NonNegativeFloat] = Field({}, description="custom Ray resources by name, e.g. {pool: 0.01} "
                                                                "to land only on nodes that advertise `pool`")

    def options(self) -> dict:
        return {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, "resources": dict(self.custom)}
