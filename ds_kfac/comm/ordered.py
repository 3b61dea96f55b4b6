"""Static buckets filled in any order and launched strictly in order: reduction overlapped with backward.

The tensors to reduce are known up front (their sizes never change), so every
rank builds the same buckets once. During a backward pass a caller hands over
each *unit* (a group of tensors, e.g. one layer's factors) as soon as it is
final; a bucket's collective starts asynchronously once the bucket and every
bucket before it are complete. Launching in bucket order, whatever order the
units arrive in, keeps the sequence of collectives identical on every rank,
which matching collectives requires. :meth:`OrderedBuckets.finish` fills in
what never arrived, launches the rest, and waits.

The collectives run on their own process group, so they can be in flight while
DeepSpeed or DDP reduce gradients on theirs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .collectives import STATS, data_parallel_world
from .network import hold


@dataclass
class _Bucket:
    units: list[int]
    segments: list[tuple[Optional[int], int, int]]  # (destination, start, end) of each collective
    numel: int
    flat: Optional[torch.Tensor] = None
    missing: int = 0
    works: Optional[list] = None


class OrderedBuckets:
    """Average units of flat tensors over ``group``: onto every rank (all-reduce) or each item onto
    its destination only (reduce, ``dsts`` given as global ranks).

    Args:
        units: per unit, the element counts of its tensors (in the order they are passed).
        dtype, device: of every tensor.
        group: the process group the collectives run on (a dedicated one, to overlap safely).
        bucket_bytes: size cap of a bucket; a unit never straddles two.
        dsts: per unit, the destination of each tensor (``None``: all-reduce).
    """

    def __init__(
        self,
        units: Sequence[Sequence[int]],
        dtype: torch.dtype,
        device: torch.device,
        group: Optional[dist.ProcessGroup],
        bucket_bytes: int,
        dsts: Optional[Sequence[Sequence[int]]] = None,
    ) -> None:
        self.dtype, self.device, self.group = dtype, device, group
        self.world = data_parallel_world(group)
        self._sizes = [list(u) for u in units]
        self._dsts = [list(d) for d in dsts] if dsts is not None else [[None] * len(u) for u in units]
        self._offsets = [[0] * len(u) for u in units]  # element offset of each tensor in its bucket
        self._bucket_of: list[int] = []
        self._filled = [False] * len(units)
        self.buckets: list[_Bucket] = []
        itemsize = torch.empty((), dtype=dtype).element_size()
        current: list[int] = []
        current_numel = 0
        for u, sizes in enumerate(self._sizes):
            if current and (current_numel + sum(sizes)) * itemsize > bucket_bytes:
                self._close(current)
                current, current_numel = [], 0
            current.append(u)
            current_numel += sum(sizes)
        if current:
            self._close(current)
        self._next = 0
        self.overlapped = 0
        """Buckets launched from :meth:`put` (before :meth:`finish`) since construction."""

    def _close(self, units: list[int]) -> None:
        """Lay a bucket out grouped by destination, so each collective is one contiguous slice."""
        items = sorted(
            ((self._dsts[u][i], u, i) for u in units for i in range(len(self._sizes[u]))),
            key=lambda item: (-1 if item[0] is None else item[0], item[1], item[2]),
        )
        segments: list[tuple[Optional[int], int, int]] = []
        offset = 0
        for dst, u, i in items:
            self._offsets[u][i] = offset
            if not segments or segments[-1][0] != dst:
                segments.append((dst, offset, offset))
            offset += self._sizes[u][i]
            segments[-1] = (dst, segments[-1][1], offset)
        for _ in units:
            self._bucket_of.append(len(self.buckets))
        self.buckets.append(_Bucket(units, segments, offset, missing=len(units)))

    def is_filled(self, unit: int) -> bool:
        """Whether ``unit`` has been handed over this round."""
        return self._filled[unit]

    def put(self, unit: int, tensors: Sequence[torch.Tensor]) -> None:
        """Hand over a unit's final tensors; launch every bucket that is now complete, in order."""
        self._store(unit, tensors)
        launched = self._launch(ready=lambda b: b.missing == 0)
        self.overlapped += launched

    def finish(self, fill: Callable[[int], Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Complete the round: ``fill(unit)`` gives the tensors of units not handed over; launch the
        remaining buckets, wait for all, and return each unit's averaged tensors (on the destination
        only, for a reduce: elsewhere their content is undefined)."""
        for b in self.buckets[self._next :]:
            for u in b.units:
                if not self._filled[u]:
                    self._store(u, fill(u))
        self._launch(ready=lambda b: True)
        out = []
        for u, sizes in enumerate(self._sizes):
            bucket = self.buckets[self._bucket_of[u]]
            if bucket.works is not None:
                for work, (dst, start, end) in zip(bucket.works, bucket.segments):
                    work.wait()
                    hold("all_reduce" if dst is None else "reduce", (end - start) * bucket.flat.element_size(),
                         self.world)  # fmt: skip
                bucket.flat.div_(self.world)
                bucket.works = None
            out.append([bucket.flat[o : o + n] for o, n in zip(self._offsets[u], sizes)])
        self._reset()
        return out

    def cancel(self) -> None:
        """Drop the current round (waiting for anything in flight, so every rank stays in step)."""
        for b in self.buckets:
            for work in b.works or ():
                work.wait()
        self._reset()

    def _store(self, unit: int, tensors: Sequence[torch.Tensor]) -> None:
        bucket = self.buckets[self._bucket_of[unit]]
        if self._filled[unit]:
            raise RuntimeError(f"unit {unit} was handed over twice in one round")
        if bucket.flat is None:
            bucket.flat = torch.empty(bucket.numel, dtype=self.dtype, device=self.device)
        for t, o, n in zip(tensors, self._offsets[unit], self._sizes[unit]):
            bucket.flat[o : o + n].copy_(t.reshape(-1))
        self._filled[unit] = True
        bucket.missing -= 1

    def _launch(self, ready: Callable[[_Bucket], bool]) -> int:
        """Launch buckets from the next one on while ``ready``; return how many."""
        launched = 0
        while self._next < len(self.buckets) and ready(self.buckets[self._next]):
            b = self.buckets[self._next]
            b.works = []
            for dst, start, end in b.segments:
                part = b.flat[start:end]
                kind = "all_reduce" if dst is None else "reduce"
                STATS[kind] += part.numel() * part.element_size()
                STATS[f"{kind}_calls"] += 1
                if dst is None:
                    b.works.append(dist.all_reduce(part, group=self.group, async_op=True))
                else:
                    b.works.append(dist.reduce(part, dst=dst, group=self.group, async_op=True))
            self._next += 1
            launched += 1
        return launched

    def _reset(self) -> None:
        for b in self.buckets:
            b.flat, b.works, b.missing = None, None, len(b.units)
        self._filled = [False] * len(self._sizes)
        self._next = 0
