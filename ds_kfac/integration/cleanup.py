"""A clean end of a distributed job: :func:`shutdown`, and what DeepSpeed's CPU all-reduce leaves behind.

On CPU, DeepSpeed 0.19 builds a shared-memory all-reduce whose workspace is a
``/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>``
segment per rank (about 69 MB), created at ``init_distributed`` and never
unlinked: every CPU job leaves them behind until the machine runs out of
memory. GPU jobs do not create them.

This module needs torch alone (DeepSpeed is used only if the job imported it),
so :func:`shutdown` also ends plain PyTorch / DDP jobs.
"""

from __future__ import annotations

import atexit
import functools
import gc
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO, Optional, Union

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
    peers map their neighbours' segments while collectives run. :func:`shutdown` does this."""
    if dist.is_available() and dist.is_initialized():
        shm_segment(dist.get_rank()).unlink(missing_ok=True)


def port_segments(port: str | int) -> list[Path]:
    """Every rank's segment of the job that used ``port`` (any address)."""
    return sorted(SHM_DIR.glob(f"{SHM_PREFIX}_{os.getuid()}_*_{port}_*"))


def release_port_segments(port: str | int) -> None:
    """Unlink every rank's segment of the job that used ``port``: for a launcher
    whose ranks were killed before they could release their own."""
    for segment in port_segments(port):
        segment.unlink(missing_ok=True)


def run_launcher(
    cmd: list[str],
    port: Union[str, int],
    timeout: float,
    cwd: Union[str, Path, None] = None,
    output: Optional[IO] = None,
    env: Optional[dict[str, str]] = None,
) -> Optional[int]:
    """Run a ``deepspeed`` launcher command (its ``--master_port`` is ``port``) in a process session of its own and
    return its exit code, ``None`` if it ran past ``timeout`` seconds: on a timeout or failure the whole session is
    killed, so no rank is left behind, and the port's shared-memory segments are removed (a killed rank cannot
    remove its own). ``output``: where its stdout and stderr go (default: inherited); ``env``: added to this
    process's environment for it."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        stdout=output,
        stderr=subprocess.STDOUT if output else None,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        release_port_segments(port)


@functools.cache
def _collect_at_exit() -> None:
    """Run a garbage collection when the interpreter exits, before its teardown (once per process).

    A DeepSpeed engine sits in reference cycles (hooks, optimizer wrappers), so it and the gloo process groups
    it still references are freed only by the interpreter's last collection, once its teardown has begun; gloo's
    destructors can then abort the process ("terminate called without an active exception", as PyTorch's
    c10d notes for groups freed during finalization). Collected from an ``atexit`` handler, they are freed while
    the interpreter is whole."""
    atexit.register(gc.collect)


def shutdown() -> None:
    """End this rank's part of the distributed job; call it on every rank at the end of training.

    A barrier (no rank tears down while a peer still talks to it), then this
    rank's DeepSpeed shared-memory segment is unlinked and every process group
    is destroyed, K-FAC's own included. A rank that exits with live gloo groups
    can abort in gloo's teardown ("terminate called without an active
    exception") and fail the job. Idempotent, and a no-op when
    ``torch.distributed`` is not initialized.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    _collect_at_exit()
    dist.barrier()
    release_deepspeed_shm()
    # DeepSpeed's own destroy also drops the group handles it caches; it is used only
    # when DeepSpeed set up this job (it is then imported and initialized).
    ds_comm = sys.modules.get("deepspeed.comm")
    if ds_comm is not None and ds_comm.is_initialized():
        ds_comm.destroy_process_group()
    else:
        dist.destroy_process_group()
