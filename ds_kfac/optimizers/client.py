"""A client optimizer named in the JSON config, for optimizers DeepSpeed's ``"optimizer"`` section cannot name.

The examples read a ``"client_optimizer"`` section, ``{"class": "package.module.Class", "params": {...}}``,
build the optimizer here and pass it to ``ds_kfac.initialize(optimizer=...)``, so a peer such as SOAP or
PSGD-Kron is rerun with the launcher from its config file alone. Optimizers that draw random numbers in their
step (PSGD's probes) draw them from a generator seeded alike on every rank: under data parallelism each rank
steps its own replica, and different draws would let the replicas drift apart with nothing reported.
"""

from __future__ import annotations

import importlib
import inspect
import random
from typing import Any, Iterable, Optional

import torch

SECTION = "client_optimizer"
"""The config section naming the client optimizer (read by the examples, never passed to DeepSpeed)."""
STEP_KEY = "random_draw_step"
"""The first param group's count of steps taken, from which each step's random draws are seeded."""


def optimizer_class(path: str) -> type[torch.optim.Optimizer]:
    """The optimizer class at the dotted ``path`` (``pytorch_optimizer.SOAP``), refused with the reason."""
    module_name, _, name = path.rpartition(".")
    if not module_name:
        raise ValueError(f"{SECTION}.class must be a dotted path such as 'pytorch_optimizer.SOAP', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ImportError(f"{SECTION}.class {path!r}: cannot import {module_name!r} ({error})") from error
    if not hasattr(module, name):
        raise ValueError(f"{SECTION}.class {path!r}: module {module_name!r} has no {name!r}")
    cls = getattr(module, name)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"{SECTION}.class {path!r} is not a torch.optim.Optimizer subclass")
    return cls


def checked_params(cls: type[torch.optim.Optimizer], params: Any) -> dict[str, Any]:
    """``params`` if each key is a named parameter of ``cls``'s constructor, else refused naming the keys: a class
    taking ``**kwargs`` (pytorch_optimizer's SOAP and Kron) would accept a misspelt one and ignore it."""
    where = f"{SECTION}.params for {cls.__module__}.{cls.__qualname__}"
    if not isinstance(params, dict):
        raise ValueError(f"{where} must be a JSON object of keyword arguments, got {params!r}")
    named = [
        p.name
        for p in list(inspect.signature(cls).parameters.values())[1:]  # after the parameters to optimize
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    unknown = sorted(set(params) - set(named))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown} (its constructor takes {named})")
    return params


def build_client_optimizer(section: dict[str, Any], params: Iterable[Any], seed: int) -> torch.optim.Optimizer:
    """The optimizer ``section`` names, over ``params``, drawing the same random numbers on every rank."""
    unknown = set(section) - {"class", "params"}
    if "class" not in section or unknown:
        raise ValueError(f"{SECTION} takes 'class' and 'params' (got keys {sorted(section)})")
    cls = optimizer_class(section["class"])
    optimizer = cls(params, **checked_params(cls, section.get("params", {})))
    same_random_on_every_rank(optimizer, seed)
    return optimizer


def pop_client_optimizer(config: dict[str, Any], params: Iterable[Any], seed: int) -> Optional[torch.optim.Optimizer]:
    """The optimizer of ``config``'s :data:`SECTION`, taken out of ``config`` (``None`` without one); refused
    with a JSON ``"optimizer"`` too, which DeepSpeed would ignore without a word for the client optimizer."""
    section = config.pop(SECTION, None)
    if section is None:
        return None
    if "optimizer" in config:
        raise ValueError(
            f'the config has both a {SECTION!r} section ({section.get("class")!r}) and an "optimizer" section '
            f"(type {config['optimizer'].get('type')!r}); DeepSpeed would train with the first and ignore the "
            f"second: keep one"
        )
    return build_client_optimizer(section, params, seed)


def same_random_on_every_rank(optimizer: torch.optim.Optimizer, seed: int) -> None:
    """Run each ``optimizer.step()`` with torch's (CPU and CUDA), NumPy's and Python's generators seeded from
    ``(seed, step)`` and restored afterwards, so random draws inside the step agree across ranks and leave the
    caller's streams (dropout, data order) as they were. The step count lives in the first param group
    (``STEP_KEY``), so it is saved with the optimizer's state and a resumed run draws what the uninterrupted one
    would; it is written there again after every step, because ZeRO 1/2's wrapper replaces the groups of the
    optimizer it partitions (without the key), and kept here meanwhile."""
    saved: dict[str, Any] = {}
    taken = optimizer.param_groups[0].setdefault(STEP_KEY, 0)  # the count, where the groups lost it

    def steps(opt: torch.optim.Optimizer) -> int:
        return opt.param_groups[0].get(STEP_KEY, taken)

    def before(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        import numpy as np

        saved.update(torch=torch.random.get_rng_state(), numpy=np.random.get_state(), python=random.getstate())
        if torch.cuda.is_initialized():  # manual_seed seeds every CUDA device too: the caller's dropout streams
            saved.update(cuda=torch.cuda.get_rng_state_all())
        step_seed = (seed * 1_000_003 + steps(opt)) % 2**31
        torch.manual_seed(step_seed)
        np.random.seed(step_seed)
        random.seed(step_seed)

    def after(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        nonlocal taken
        import numpy as np

        torch.random.set_rng_state(saved["torch"])
        np.random.set_state(saved["numpy"])
        random.setstate(saved["python"])
        if "cuda" in saved:
            torch.cuda.set_rng_state_all(saved.pop("cuda"))
        taken = opt.param_groups[0][STEP_KEY] = steps(opt) + 1

    optimizer.register_step_pre_hook(before)
    optimizer.register_step_post_hook(after)
