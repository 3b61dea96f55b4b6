"""Have a framework that calls ``deepspeed.initialize`` itself build a :class:`ds_kfac.KFACEngine`.

accelerate (and so Hugging Face ``Trainer``) builds its engine with
``deepspeed.initialize``, read from the ``deepspeed`` module at call time, and
offers no way to pass another function. :func:`kfac_initialize_once` replaces
that module attribute by :func:`ds_kfac.initialize` for exactly one call, inside
one ``with`` block: the only patch ds_kfac makes (listed in docs/maintainers.md).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import deepspeed

from .initialize import initialize


@contextlib.contextmanager
def kfac_initialize_once() -> Iterator[list[Any]]:
    """Within the block, the first call of ``deepspeed.initialize`` runs :func:`ds_kfac.initialize`
    (same arguments, same return values); ``deepspeed.initialize`` is DeepSpeed's own again from that
    call on (``ds_kfac.initialize`` may call it itself) and after the block.

    Yields a list that receives the engine built, so the caller can check the substitution happened.
    """
    original = deepspeed.initialize
    built: list[Any] = []

    def initialize_with_kfac(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any, Any]:
        deepspeed.initialize = original
        result = initialize(*args, **kwargs)
        built.append(result[0])
        return result

    deepspeed.initialize = initialize_with_kfac
    try:
        yield built
    finally:
        deepspeed.initialize = original
