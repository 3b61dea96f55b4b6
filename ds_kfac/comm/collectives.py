"""Collectives on flat buffers, with a byte count of everything K-FAC sends.

Many small per-layer tensors are packed into a few flat buffers (one per
dtype and device, each at most ``bucket_bytes``) so that a step issues a
handful of collectives instead of one per tensor. All collectives of a call
are launched asynchronously and waited on together. Every K-FAC collective
goes through this module, and :data:`STATS` counts its payload bytes, so the
documented per-step volume of each mode can be checked (``tests/``).
"""

from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence

import torch
import torch.distributed as dist

DEFAULT_BUCKET_BYTES = 32 * 2**20

STATS: Counter[str] = Counter()
"""Payload bytes this process has passed to each collective (``"all_reduce"``), and call counts (``"all_reduce_calls"``)."""


def data_parallel_world(group: Optional[dist.ProcessGroup] = None) -> int:
    """Size of ``group`` (the default group if ``None``); 1 when not distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``tensors`` grouped by dtype and device, each group at most
    ``bucket_bytes`` (a single larger tensor gets a bucket of its own)."""
    out: list[list[int]] = []
    open_bucket: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    for i, t in enumerate(tensors):
        key = (t.dtype, t.device)
        idx, size = open_bucket.get(key, ([], 0))
        nbytes = t.numel() * t.element_size()
        if idx and size + nbytes > bucket_bytes:
            out.append(idx)
            idx, size = [], 0
        idx.append(i)
        open_bucket[key] = (idx, size + nbytes)
    out.extend(idx for idx, _ in open_bucket.values())
    return out


def _all_reduce_(
    tensors: Sequence[torch.Tensor], group: Optional[dist.ProcessGroup], bucket_bytes: int, average: bool
) -> None:
    world = data_parallel_world(group)
    if world == 1 or not tensors:
        return
    pending = []
    for idx in buckets(tensors, bucket_bytes):
        flat = torch.cat([tensors[i].reshape(-1) for i in idx])
        STATS["all_reduce"] += flat.numel() * flat.element_size()
        STATS["all_reduce_calls"] += 1
        pending.append((idx, flat, dist.all_reduce(flat, group=group, async_op=True)))
    for idx, flat, work in pending:
        work.wait()
        if average:
            flat.div_(world)
        offset = 0
        for i in idx:
            n = tensors[i].numel()
            tensors[i].copy_(flat[offset : offset + n].view_as(tensors[i]))
            offset += n


def all_reduce_mean_(
    tensors: Sequence[torch.Tensor],
    group: Optional[dist.ProcessGroup] = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> None:
    """Average ``tensors`` in place over the ranks of ``group``."""
    _all_reduce_(tensors, group, bucket_bytes, average=True)


def all_reduce_sum_(
    tensors: Sequence[torch.Tensor],
    group: Optional[dist.ProcessGroup] = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> None:
    """Sum ``tensors`` in place over the ranks of ``group``."""
    _all_reduce_(tensors, group, bucket_bytes, average=False)
