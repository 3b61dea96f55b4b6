"""The process groups a placement plan needs, created once.

Plans speak in data-parallel ranks ``0..world-1``; collectives need global
ranks and groups. :class:`RankGroups` maps between them and creates one group
per column (gradient workers of a layer) and per row (receivers of
preconditioned gradients) at construction: never per step or per checkpoint.
"""

from __future__ import annotations

from typing import Optional

import torch.distributed as dist


class RankGroups:
    """Global ranks of a data-parallel group, and the column/row groups of an ``n``-worker layout."""

    def __init__(self, n: int, group: Optional[dist.ProcessGroup] = None) -> None:
        self.group = group
        self.global_ranks = (
            dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        )
        world = len(self.global_ranks)
        self.rank = self.global_ranks.index(dist.get_rank())
        columns = [list(range(k * n, (k + 1) * n)) for k in range(world // n)]
        rows = [list(range(j, world, n)) for j in range(n)]
        # Every rank creates every group, in the same order, as torch.distributed requires.
        self.columns = [self._new_group(members, world) for members in columns]
        self.rows = [self._new_group(members, world) for members in rows]

    def _new_group(self, members: list[int], world: int) -> Optional[dist.ProcessGroup]:
        if len(members) == world:
            return self.group
        return dist.new_group([self.global_ranks[m] for m in members])

    def to_global(self, rank: int) -> int:
        return self.global_ranks[rank]
