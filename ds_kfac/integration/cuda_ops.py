"""``TORCH_CUDA_ARCH_LIST`` for DeepSpeed's JIT-built CUDA ops (``FusedLamb``), in a form its builder parses.

DeepSpeed 0.19.8's ``OpBuilder.compute_capability_args`` (``deepspeed/ops/op_builder/builder.py``) splits the list
on ``;`` or spaces and reads each entry as ``int(part.split('+')[0]) for part in entry.split('.')``: ``"9.0+PTX"``
parses, while the arch-specific suffixes PyTorch accepts (``"9.0a"``, ``"10.0f"``) raise ``ValueError: invalid
literal for int() with base 10: '0a'`` and the op does not build. :func:`deepspeed_arch_list` builds for the visible
devices' compute capabilities instead (also when the variable is unset, as DeepSpeed's own probe would), and puts
the user's variable back afterwards.

Imports torch alone: ``optimizers/resolve.py`` loads it inside ``_build_deepspeed``.
"""

from __future__ import annotations

import logging
import os
import re
from contextlib import contextmanager
from typing import Iterable, Iterator, Optional

import torch

logger = logging.getLogger(__name__)

ARCH_LIST_ENV = "TORCH_CUDA_ARCH_LIST"
_PARSED_ENTRY = re.compile(r"[0-9]+\.[0-9]+(\+[^.]*)?")
"""An entry DeepSpeed's builder reads: ``major.minor`` with an optional ``+`` suffix (``+PTX``)."""
_announced = False
"""Whether this process has logged that it replaced the arch list (once, not once per build)."""


def arch_entries(arch_list: str) -> list[str]:
    """The entries of an arch list, split as DeepSpeed splits it (``;`` or spaces)."""
    return [entry.strip() for entry in arch_list.replace(" ", ";").split(";") if entry.strip()]


def buildable_arch_list(current: Optional[str], capabilities: Iterable[tuple[int, int]]) -> Optional[str]:
    """The arch list DeepSpeed's builder parses: ``current`` when every entry parses, else (unset, blank, or an
    entry such as ``"9.0a"``) the ``capabilities``, deduplicated and sorted (``"8.0;9.0"``); ``current`` when there
    are no capabilities, so that DeepSpeed's own error surfaces."""
    if current is not None and current.strip() and all(_PARSED_ENTRY.fullmatch(e) for e in arch_entries(current)):
        return current
    unique = sorted(set(capabilities))
    return ";".join(f"{major}.{minor}" for major, minor in unique) if unique else current


def device_capabilities() -> list[tuple[int, int]]:
    """The compute capability of every visible CUDA device (none without CUDA)."""
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())]


@contextmanager
def deepspeed_arch_list() -> Iterator[Optional[str]]:
    """``TORCH_CUDA_ARCH_LIST`` set to :func:`buildable_arch_list` of the current value and the visible devices for
    a DeepSpeed op build inside the block (yields the value it builds with), then restored exactly: set to what it
    was, or unset. Logs the first replacement of the process."""
    global _announced
    previous = os.environ.get(ARCH_LIST_ENV)
    value = buildable_arch_list(previous, device_capabilities())
    if value != previous and not _announced:
        _announced = True
        unset = not (previous or "").strip()
        reason = "is unset" if unset else f"is {previous!r}, which DeepSpeed's op builder cannot parse"
        level = logging.INFO if unset else logging.WARNING  # replacing the user's own setting is worth a warning
        logger.log(
            level, "%s %s: building DeepSpeed's CUDA ops for the visible devices, %s", ARCH_LIST_ENV, reason, value
        )
    try:
        if value is not None:
            os.environ[ARCH_LIST_ENV] = value
        yield value
    finally:  # the builder may also have written it
        if previous is None:
            os.environ.pop(ARCH_LIST_ENV, None)
        else:
            os.environ[ARCH_LIST_ENV] = previous
