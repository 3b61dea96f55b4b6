"""Collectives on flat buffers, with a byte count of everything K-FAC sends.

Many small per-layer tensors are packed into a few flat buffers (one per
dtype and device, each at most ``bucket_bytes``) so that a step issues a
handful of collectives instead of one per tensor. All collectives of a call
are launched asynchronously and waited on together. Every K-FAC collective
goes through this module, and :data:`STATS` counts its payload bytes, so the
documented per-step volume of each mode can be checked (``tests/``).
Checkpoints move state point to point (:func:`send_`, :func:`receive`), tensor
by tensor, each to the one rank that saves.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .network import hold

DEFAULT_BUCKET_BYTES = 32 * 2**20

STATS: Counter[str] = Counter()
"""Payload bytes per collective kind on this process (``"all_reduce"``, ``"reduce"``; ``"broadcast"``
counts what this rank sends as source, ``"send"`` what it sends point to point, ``"all_to_all"`` what it
sends to other ranks; ``"easgd_all_reduce"`` the EASGD weights' all-reduce, :mod:`ds_kfac.easgd`; ``"tp_gather"`` and ``"tp_scatter"`` what this rank sends
to other ranks of its tensor-parallel group, :func:`gather_`, :func:`scatter_`), and call counts
(``"<kind>_calls"``)."""


def data_parallel_world(group: Optional[dist.ProcessGroup] = None) -> int:
    """Size of ``group`` (the default group if ``None``); 1 when not distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def data_parallel_rank(group: Optional[dist.ProcessGroup] = None) -> int:
    """This process's rank in ``group`` (the default group if ``None``); 0 when not distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.get_rank(group)


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


def all_reduce_sum_(
    tensors: Sequence[torch.Tensor],
    group: Optional[dist.ProcessGroup] = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> None:
    """Sum ``tensors`` in place over the ranks of ``group``."""
    if data_parallel_world(group) == 1 or not tensors:
        return
    pending = []
    for idx in buckets(tensors, bucket_bytes):
        flat = torch.cat([tensors[i].reshape(-1) for i in idx])
        STATS["all_reduce"] += flat.numel() * flat.element_size()
        STATS["all_reduce_calls"] += 1
        pending.append((idx, flat, dist.all_reduce(flat, group=group, async_op=True)))
    world = data_parallel_world(group)
    for idx, flat, work in pending:
        work.wait()
        hold("all_reduce", flat.numel() * flat.element_size(), world)
        _unpack(flat, tensors, idx)


def start_all_reduce_sum_(flat: torch.Tensor, group: Optional[dist.ProcessGroup], stat: str) -> dist.Work:
    """Start summing one flat buffer in place over ``group``'s ranks; its bytes count under ``stat``. The caller
    waits on the returned work (EASGD overlaps it with the next step's compute)."""
    STATS[stat] += flat.numel() * flat.element_size()
    STATS[f"{stat}_calls"] += 1
    return dist.all_reduce(flat, group=group, async_op=True)


def _flat_buckets(tensors: Sequence[torch.Tensor], keys: Sequence[tuple], bucket_bytes: int) -> list[list[int]]:
    """Buckets of tensor indices sharing a key (destination, group, ...) and dtype, in first-seen order."""
    grouped: dict[tuple, list[int]] = {}
    for i, key in enumerate(keys):
        grouped.setdefault((key, tensors[i].dtype, tensors[i].device), []).append(i)
    out = []
    for idx in grouped.values():
        out.extend([idx[j] for j in b] for b in buckets([tensors[i] for i in idx], bucket_bytes))
    return out


def _unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor], idx: Sequence[int]) -> None:
    offset = 0
    for i in idx:
        n = tensors[i].numel()
        tensors[i].copy_(flat[offset : offset + n].view_as(tensors[i]))
        offset += n


def broadcast_(
    tensors: Sequence[torch.Tensor],
    srcs: Sequence[int],
    groups: Sequence[Optional[dist.ProcessGroup]],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> None:
    """Broadcast each tensor from its source (a global rank) within its group, in place.

    Every member of a group must pass that group's tensors in the same order;
    receivers pass buffers of the right shape and dtype.
    """
    if not tensors:
        return
    me = dist.get_rank()
    pending = []
    for idx in _flat_buckets(tensors, [(s, id(g)) for s, g in zip(srcs, groups)], bucket_bytes):
        src, group = srcs[idx[0]], groups[idx[0]]
        flat = torch.cat([tensors[i].reshape(-1) for i in idx])
        if src == me:
            STATS["broadcast"] += flat.numel() * flat.element_size()
            STATS["broadcast_calls"] += 1
        pending.append((idx, flat, src, dist.broadcast(flat, src=src, group=group, async_op=True)))
    for idx, flat, src, work in pending:
        work.wait()
        hold("broadcast", flat.numel() * flat.element_size(), data_parallel_world(groups[idx[0]]))
        if src != me:
            _unpack(flat, tensors, idx)


def all_to_all_(
    send: Sequence[Sequence[torch.Tensor]],
    recv: Sequence[Sequence[torch.Tensor]],
    group: Optional[dist.ProcessGroup],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Send the tensors ``send[r]`` to rank ``r`` of ``group`` and receive ``recv[r]`` from it, in place, in one
    collective (all of ``dtype``; rank ``r``'s ``send[me]`` matches this rank's ``recv[r]`` in order and sizes).
    ``"all_to_all"`` counts the bytes this rank sends to the other ranks."""
    me = data_parallel_rank(group)
    empty = torch.empty(0, dtype=dtype, device=device)
    flat = [torch.cat([t.reshape(-1) for t in pieces]) if pieces else empty for pieces in send]
    sizes = [sum(t.numel() for t in pieces) for pieces in recv]
    out = torch.empty(sum(sizes), dtype=dtype, device=device)
    if data_parallel_world(group) == 1:
        out.copy_(flat[me])
    else:
        STATS["all_to_all"] += sum(t.numel() * t.element_size() for r, t in enumerate(flat) if r != me)
        STATS["all_to_all_calls"] += 1
        dist.all_to_all_single(out, torch.cat(flat), sizes, [t.numel() for t in flat], group=group)
        hold("all_to_all", sum(t.numel() * t.element_size() for r, t in enumerate(flat) if r != me),
             data_parallel_world(group))  # fmt: skip
    received = [t for pieces in recv for t in pieces]
    _unpack(out, received, range(len(received)))


def send_(
    tensors: Sequence[Optional[torch.Tensor]],
    dst: int,
    group: Optional[dist.ProcessGroup],
    device: torch.device,
) -> None:
    """Send ``tensors`` (on ``device``; ``None`` where absent) to global rank ``dst``, where :func:`receive`
    takes them: first which are present (one byte each), then each present tensor, not copied."""
    if not tensors:
        return
    present = [t.contiguous() for t in tensors if t is not None]
    flags = torch.tensor([t is not None for t in tensors], dtype=torch.uint8, device=device)
    works = [dist.isend(t, dst=dst, group=group) for t in [flags, *present]]
    STATS["send"] += flags.numel() + sum(t.numel() * t.element_size() for t in present)
    STATS["send_calls"] += len(works)
    for work in works:
        work.wait()


def receive(
    specs: Sequence[tuple[tuple[int, ...], torch.dtype]],
    srcs: Sequence[int],
    group: Optional[dist.ProcessGroup],
    device: torch.device,
) -> list[Optional[torch.Tensor]]:
    """The other end of :func:`send_`: tensor ``i``, of shape and dtype ``specs[i]``, from global rank
    ``srcs[i]`` (each source's tensors in the order it sent them); ``None`` where it sent none."""
    by_src: dict[int, list[int]] = {}
    for i, src in enumerate(srcs):
        by_src.setdefault(src, []).append(i)
    flags = {src: torch.empty(len(idx), dtype=torch.uint8, device=device) for src, idx in by_src.items()}
    for work in [dist.irecv(f, src=src, group=group) for src, f in flags.items()]:
        work.wait()
    out: list[Optional[torch.Tensor]] = [None] * len(specs)
    works = []
    for src, idx in by_src.items():
        for i, present in zip(idx, flags[src].tolist()):
            if present:
                shape, dtype = specs[i]
                out[i] = torch.empty(shape, dtype=dtype, device=device)
                works.append(dist.irecv(out[i], src=src, group=group))
    for work in works:
        work.wait()
    return out


def pack_symmetric(matrix: torch.Tensor) -> torch.Tensor:
    """The upper triangle (with diagonal) of a symmetric matrix, row by row."""
    rows, cols = torch.triu_indices(matrix.shape[0], matrix.shape[1], device=matrix.device)
    return matrix[rows, cols]


def unpack_symmetric(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of :func:`pack_symmetric`."""
    rows, cols = torch.triu_indices(dim, dim, device=packed.device)
    out = packed.new_empty(dim, dim)
    out[rows, cols] = packed
    out[cols, rows] = packed
    return out


def gather_(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup) -> Optional[list[torch.Tensor]]:
    """Every rank's ``tensor`` (same shape and dtype on all) on rank ``dst`` of ``group``, in group-rank order;
    ``None`` on the others. ``"tp_gather"`` counts what a rank sends to ``dst``."""
    me = dist.get_rank(group)
    tensor = tensor.contiguous()
    if me != dst:
        STATS["tp_gather"] += tensor.numel() * tensor.element_size()
        STATS["tp_gather_calls"] += 1
        dist.gather(tensor, None, dst=dist.get_global_rank(group, dst), group=group)
        return None
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.gather(tensor, out, dst=dist.get_global_rank(group, dst), group=group)
    return out


def scatter_(out: torch.Tensor, pieces: Optional[Sequence[torch.Tensor]], src: int, group: dist.ProcessGroup) -> None:
    """Rank ``src`` of ``group`` sends ``pieces[r]`` to rank ``r``, which receives it into ``out`` (its shape and
    dtype). ``"tp_scatter"`` counts what ``src`` sends to the other ranks."""
    if dist.get_rank(group) == src:
        pieces = [p.contiguous() for p in pieces]
        STATS["tp_scatter"] += sum(p.numel() * p.element_size() for i, p in enumerate(pieces) if i != src)
        STATS["tp_scatter_calls"] += 1
    dist.scatter(out, pieces, src=dist.get_global_rank(group, src), group=group)
