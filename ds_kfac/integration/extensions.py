"""DeepSpeed's JIT-built ops and torch's build lock: a start-up that never waits silently on a stale lock.

On CPU, ``deepspeed.init_distributed`` loads DeepSpeed's shared-memory communication op through
``torch.utils.cpp_extension.load``, which builds it under a lock file (``<extensions dir>/<op>/lock``) and, in every
other process, waits for that file to disappear, with no time limit and no message. A build interrupted while it
held the lock (Ctrl-C, a killed rank, a timeout during start-up) leaves the file behind, and from then on every
DeepSpeed start-up on the machine waits forever. :func:`refuse_stale_build_locks` runs before DeepSpeed starts
(:func:`ds_kfac.init_distributed`, ``ds_kfac.initialize``): a lock that outlives a short grace period while no
process is building in its directory is stale, and it raises naming the file to remove. A build in progress (a
process working in that directory, as the compiler run by ninja does) is waited for.

The extensions directory is torch's: ``$TORCH_EXTENSIONS_DIR``, else a per-Python directory under
``~/.cache/torch_extensions``, which every environment with that Python shares (and rebuilds into whenever it
switches environment). The Makefile gives this project's commands a directory of their own,
``.venv/torch_extensions`` (docs/deepspeed.md).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

OPS = ("ShareMemCommBuilder",)
"""The DeepSpeed op builders whose ops ``deepspeed.init_distributed`` loads on CPU."""

GRACE_SECONDS = 5.0
"""How long a lock may exist with no build running before it counts as stale (torch holds it for milliseconds
between taking it and starting ninja, and while it checks an already built op)."""


def build_lock(op: str) -> Path | None:
    """The lock file torch uses while building DeepSpeed's ``op`` builder's extension (``None`` where the accelerator
    has no such op: it is not built here). torch's own ``_get_build_directory`` names the directory (listed in
    docs/maintainers.md)."""
    from deepspeed.accelerator import get_accelerator
    from torch.utils.cpp_extension import _get_build_directory

    builder = get_accelerator().create_op_builder(op)
    if builder is None:
        return None
    return Path(_get_build_directory(builder.name, verbose=False)) / "lock"


def building_in(directory: Path) -> bool:
    """Whether a process works in ``directory`` (its current directory there: ninja and the compiler it runs), read
    from ``/proc``; ``False`` where there is no ``/proc``."""
    proc = Path("/proc")
    if not proc.is_dir():
        return False
    target = os.path.realpath(directory)
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.path.realpath(entry / "cwd") == target:
                return True
        except OSError:  # the process ended, or it is not ours to read
            continue
    return False


def refuse_stale_build_locks(grace: float = GRACE_SECONDS, ops: tuple[str, ...] = OPS) -> None:
    """Return once no build lock of ``ops`` exists (waiting while a build runs); raise ``RuntimeError`` naming the
    file once it has existed for ``grace`` seconds with no build running. The lock's age counts: one written more
    than ``grace`` seconds ago (by its modification time) with no build running is refused at once."""
    for op in ops:
        lock = build_lock(op)
        if lock is None:
            continue
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:  # released meanwhile
            continue
        # A clock that disagrees with the file's (a future modification time) counts the grace from now.
        deadline = time.monotonic() + grace - min(max(age, 0.0), grace)
        while lock.exists():
            if building_in(lock.parent):
                deadline = time.monotonic() + grace
            elif time.monotonic() > deadline:
                raise RuntimeError(
                    f"{lock} exists but no process is building in {lock.parent}: it is the lock of an interrupted "
                    f"build of DeepSpeed's {lock.parent.name} op (Ctrl-C, a killed rank or a timeout during "
                    f"start-up), and while it exists every DeepSpeed start-up that uses this extensions directory "
                    f"waits on it forever (torch.utils.cpp_extension). Remove it (rm {lock}) and start again"
                )
            time.sleep(0.1)


def init_distributed(**kwargs: Any) -> None:
    """``deepspeed.init_distributed`` (the accelerator's backend unless ``dist_backend`` is given) after
    :func:`refuse_stale_build_locks`: a training script's first call, before ``ds_kfac.initialize``, so that a stale
    build lock stops it within seconds instead of hanging it."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    refuse_stale_build_locks()
    kwargs.setdefault("dist_backend", get_accelerator().communication_backend_name())
    deepspeed.init_distributed(**kwargs)
