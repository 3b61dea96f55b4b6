"""Data faults during training: every rank stops at the same step, one line naming the file and the cause.

Data checked before step 1 can still fail while a job runs: a shard truncated or replaced under it, an HDF5 file
whose compressed data is corrupt past its header, an id outside the vocabulary, a loader worker killed. A rank that
raised on its own would leave the others waiting in the step's next collective (gloo or NCCL, until their timeout),
and a short read taken as data trains on garbage (NaN losses, exit code 0). So:

- a loader worker that cannot make a micro-batch returns a :class:`Fault` naming the file and the cause in its place
  (:func:`caught`: the error does not cross the process boundary as a traceback);
- each rank fetches all micro-batches of an optimizer step before its first forward (:func:`fetch_step`), and the
  ranks then all-reduce one integer, "did any rank fail" (:func:`agree`): one 4-byte collective per optimizer step,
  before any of the step's others, so a fault on any rank stops every rank at that step, none left in a collective.

:class:`DataFault` is raised on every rank; ``pretrain.py`` ends its loader, prints the faulting rank's message once
(rank 0) and exits 1.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

import torch
import torch.distributed as dist

FAULTS = (ValueError, OSError)
"""What reading a micro-batch raises on bad data: ``ShardError`` and id checks (``ValueError``), short or failed
reads and h5py's decompression errors (``OSError``)."""

K = TypeVar("K")


@dataclass(frozen=True)
class Fault:
    """In place of a micro-batch that could not be made: what went wrong, naming the file."""

    message: str


class DataFault(RuntimeError):
    """Some rank could not make its micro-batches of a step: raised on every rank (``message``: the first faulting
    rank's, prefixed with its rank)."""


def caught(make: Callable[[Any, K], dict[str, Any]]) -> Callable[[Any, K], dict[str, Any] | Fault]:
    """A dataset's ``__getitem__`` returning a :class:`Fault` where it raised one of :data:`FAULTS`."""

    @functools.wraps(make)
    def guarded(self: Any, key: K) -> dict[str, Any] | Fault:
        try:
            return make(self, key)
        except FAULTS as error:
            return Fault(str(error).splitlines()[0] if str(error) else type(error).__name__)

    return guarded


def fetch_step(batches: Iterator[Any], accum: int) -> tuple[list[Any], Optional[str]]:
    """The ``accum`` micro-batches of one step from ``batches``, or what stopped them (a :class:`Fault`'s message,
    or the loader's own failure: a worker killed, say)."""
    fetched: list[Any] = []
    try:
        for _ in range(accum):
            batch = next(batches)
            if isinstance(batch, Fault):
                return fetched, batch.message
            fetched.append(batch)
    except StopIteration:
        raise
    except Exception as error:  # any failure of the loader stops every rank, named
        first = str(error).strip().splitlines()
        return fetched, f"the data loader failed: {type(error).__name__}: {first[0] if first else ''}"
    return fetched, None


def agree(fault: Optional[str], device: Optional[torch.device] = None) -> None:
    """Every rank's verdict (``None``: all is well), all-reduced; :class:`DataFault` on every rank if any failed,
    with the failing ranks' message (prefixed with the first failing rank where not every rank failed alike).
    ``device``: where the flag lives (default: the current CUDA device under NCCL, else the CPU)."""
    if device is None:
        nccl = dist.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    flag = torch.tensor([0 if fault is None else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if not int(flag.item()):
        return
    messages: list[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, fault)
    rank, message = next((r, m) for r, m in enumerate(messages) if m is not None)
    raise DataFault(message if len(set(messages)) == 1 else f"rank {rank}: {message}")
