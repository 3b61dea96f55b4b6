"""The process groups a placement plan needs, created once.

Plans speak in data-parallel ranks ``0..world-1``; collectives need global
ranks and groups. :class:`RankGroups` maps between them and creates one group
per rank set the plan exchanges data within (columns and rows of gradient
workers, or the holders of a ZeRO-split layer), plus one of all ranks for
factor reduction overlapped with the backward pass, at construction: never
per step or per checkpoint.

``torch.distributed`` needs every process of the job to create every group,
in the same order. With tensor or pipeline parallelism the data-parallel
groups differ from rank to rank (one per shard and stage), and so do the
groups their plans need: :func:`create_groups` agrees on all of them first.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence

import torch.distributed as dist

Members = tuple[int, ...]


def create_groups(wanted: Sequence[Members]) -> list[Optional[dist.ProcessGroup]]:
    """One new process group per entry of ``wanted`` (global ranks; ``None`` where this rank is not a member).

    Collective over the whole job: each rank's wants are exchanged (one ``all_gather_object``), and every
    rank creates the union in one sorted order. Ranks asking for the same members the same number of times
    share those groups (the k-th request of members ``m`` on one rank is the k-th on the others), so the
    members of a group must ask for it alike: ranks of one data-parallel group, which share a plan, do."""
    keys = _keyed([tuple(sorted(m)) for m in wanted])
    everyone: list[Optional[list[tuple[Members, int]]]] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, keys)
    me = dist.get_rank()
    created: dict[tuple[Members, int], Optional[dist.ProcessGroup]] = {}
    for key in sorted({key for theirs in everyone for key in theirs}):
        group = dist.new_group(list(key[0]))
        created[key] = group if me in key[0] else None
    return [created[key] for key in keys]


def _keyed(wanted: Sequence[Members]) -> list[tuple[Members, int]]:
    """Each request with its occurrence index among this rank's requests of the same members."""
    seen: Counter[Members] = Counter()
    keys = []
    for members in wanted:
        keys.append((members, seen[members]))
        seen[members] += 1
    return keys


class RankGroups:
    """Global ranks of a data-parallel group, and a process group for each given set of its ranks.

    Collective over the whole job (:func:`create_groups`): every rank constructs its own at the same point."""

    def __init__(
        self, sets: Sequence[Members], group: Optional[dist.ProcessGroup] = None, overlap: bool = False
    ) -> None:
        self.group = group
        self.global_ranks = (
            dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        )
        world = len(self.global_ranks)
        self.rank = self.global_ranks.index(dist.get_rank())
        new = [members for members in dict.fromkeys(sets) if len(members) != world]  # all ranks: the group itself
        wanted = [tuple(self.global_ranks[m] for m in members) for members in new]
        if overlap:
            wanted.append(tuple(self.global_ranks))
        groups = create_groups(wanted)
        self._groups = {members: self.group for members in sets} | dict(zip(new, groups))
        self.overlap = groups[-1] if overlap else None
        """All ranks again, for collectives that run while the engine reduces gradients on ``group``."""

    def of(self, members: Members) -> Optional[dist.ProcessGroup]:
        """The process group of a rank set named by the plan."""
        return self._groups[members]

    def to_global(self, rank: int) -> int:
        return self.global_ranks[rank]
