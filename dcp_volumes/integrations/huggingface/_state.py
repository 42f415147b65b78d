"""What a Hugging Face checkpoint holds, as DCP state: the model and its optimizers through
``torch.distributed.checkpoint.state_dict`` (canonical FQNs, so DDP, FSDP and one process
save and load the same keys), and the small extras (scheduler, scaler, RNG, trainer state)
as non-tensor items of the same save, so one ``.metadata`` commit covers everything.

Everything here is framework-neutral torch; ``_accelerate`` and ``_trainer`` choose what goes in.
Every non-tensor item is made of containers, numbers, strings and tensors only, so the
reader's weights-only unpickler loads it without ``safe_globals``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from dcp_volumes import errors

__all__ = [
    "OptionalKeysPlanner",
    "apply_rng",
    "capture_rng",
    "load_model_optimizers",
    "model_optimizer_state",
    "raw_optimizer",
    "rng_key",
]


def raw_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside Accelerate's ``AcceleratedOptimizer`` (or ``optimizer``)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        raise errors.ConfigError(
            f"cannot checkpoint an optimizer of type {type(optimizer).__name__}: pass a "
            "torch.optim.Optimizer (or Accelerate's wrapper of one)")
    return inner


def _pairs(models: Sequence[torch.nn.Module], optimizers: Sequence[Any]
           ) -> list[tuple[torch.nn.Module, torch.optim.Optimizer]]:
    """Each optimizer with the model that owns its parameters: by index, or all with the
    one model (as Accelerate pairs them for FSDP)."""
    if optimizers and not models:
        raise errors.ConfigError(
            "optimizers without a model cannot be checkpointed by parameter name: prepare "
            "the model with the Accelerator too")
    if len(models) != 1 and len(models) != len(optimizers) and optimizers:
        raise errors.ConfigError(
            f"{len(models)} models and {len(optimizers)} optimizers: pair them one to one, or "
            "use one model for every optimizer")
    return [(models[0] if len(models) == 1 else models[i], raw_optimizer(opt))
            for i, opt in enumerate(optimizers)]


def model_optimizer_state(models: Sequence[torch.nn.Module], optimizers: Sequence[Any]
                          ) -> tuple[dict[str, Any], dict[str, Any]]:
    """``({"0": model_sd, ...}, {"0": optim_sd, ...})``: sharded where the models are (FSDP,
    DTensor), plain tensors otherwise; keys are canonical FQNs (no ``module.`` prefix).

    An optimizer that has not stepped yet gets its state initialised (a zero-gradient step
    at learning rate 0, as ``get_optimizer_state_dict`` does), so the result is a complete
    template to load into.
    """
    model_states = {str(i): get_model_state_dict(m) for i, m in enumerate(models)}
    optim_states = {str(i): get_optimizer_state_dict(m, o)
                    for i, (m, o) in enumerate(_pairs(models, optimizers))}
    return model_states, optim_states


def load_model_optimizers(models: Sequence[torch.nn.Module], optimizers: Sequence[Any],
                          model_states: dict[str, Any], optim_states: dict[str, Any]) -> None:
    """Put loaded states back (the counterpart of :func:`model_optimizer_state`)."""
    for i, model in enumerate(models):
        set_model_state_dict(model, model_states[str(i)])
    for i, (model, optim) in enumerate(_pairs(models, optimizers)):
        set_optimizer_state_dict(model, optim, optim_states[str(i)])


# ---- RNG -----------------------------------------------------------------------------------
def rng_key(process_index: int) -> str:
    """The item name of one process's RNG state (each process saves its own)."""
    return f"rank-{process_index}"


def capture_rng() -> dict[str, Any]:
    """This process's random states (Python, NumPy, torch CPU and CUDA) as safe items.

    NumPy's state is kept as a tuple of plain numbers (not an array), so loading it needs
    no extra allowed globals.
    """
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (str(name), [int(k) for k in keys], int(pos), int(has_gauss), float(cached)),
        "torch": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.random.get_rng_state_all()
    return state


def apply_rng(state: dict[str, Any]) -> None:
    """Restore what :func:`capture_rng` captured (the devices this process has)."""
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.random.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.random.set_rng_state_all(state["cuda"])


class OptionalKeysPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that keys under ``optional`` prefixes (flattened
    names, e.g. ``"rng.rank-3"``) load only where the checkpoint has them: a checkpoint
    saved on fewer processes has no RNG state for the new ones. Every other key is strict.

    ``missing`` names the optional keys the checkpoint did not have (after the load).
    """

    def __init__(self, optional: tuple[str, ...]) -> None:
        super().__init__()
        self.optional = optional
        self.missing: set[str] = set()

    def create_local_plan(self) -> Any:
        if self.metadata is not None:
            stored = self.metadata.state_dict_metadata
            for fqn in [k for k in self.state_dict if k.startswith(self.optional)]:
                if fqn not in stored:
                    del self.state_dict[fqn]
                    self.missing.add(fqn)
        return super().create_local_plan()
