"""Release what DeepSpeed's CPU shared-memory all-reduce leaves behind.

On CPU, DeepSpeed 0.19 builds a shared-memory all-reduce whose workspace is a
``/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>``
segment per rank (about 69 MB), created at ``init_distributed`` and never
unlinked: every CPU job leaves them behind until the machine runs out of
memory. GPU jobs do not create them.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "deepspeed_allreduce_buffer"


def shm_segment(rank: int, addr: str | None = None, port: str | None = None) -> Path:
    """The segment DeepSpeed names for ``rank`` under the current (or given) master address and port."""
    addr = os.environ.get("MASTER_ADDR", "") if addr is None else addr
    port = os.environ.get("MASTER_PORT", "") if port is None else port
    return SHM_DIR / f"{SHM_PREFIX}_{os.getuid()}_{addr}_{port}_{rank}"


def release_deepspeed_shm() -> None:
    """Unlink this rank's segment. Call on every rank after its last collective (after a barrier):
    peers map their neighbours' segments while collectives run."""
    if dist.is_available() and dist.is_initialized():
        shm_segment(dist.get_rank()).unlink(missing_ok=True)


def release_port_segments(port: str | int) -> None:
    """Unlink every rank's segment of the job that used ``port`` (any address): for a launcher
    whose ranks were killed before they could release their own."""
    for segment in SHM_DIR.glob(f"{SHM_PREFIX}_{os.getuid()}_*_{port}_*"):
        segment.unlink(missing_ok=True)
