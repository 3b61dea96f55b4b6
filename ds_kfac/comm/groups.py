"""The process groups a placement plan needs, created once.

Plans speak in data-parallel ranks ``0..world-1``; collectives need global
ranks and groups. :class:`RankGroups` maps between them and creates one group
per rank set the plan exchanges data within (columns and rows of gradient
workers, or the holders of a ZeRO-split layer), plus one of all ranks for
factor reduction overlapped with the backward pass, at construction: never
per step or per checkpoint.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch.distributed as dist


class RankGroups:
    """Global ranks of a data-parallel group, and a process group for each given set of its ranks."""

    def __init__(
        self, sets: Sequence[tuple[int, ...]], group: Optional[dist.ProcessGroup] = None, overlap: bool = False
    ) -> None:
        self.group = group
        self.global_ranks = (
            dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        )
        world = len(self.global_ranks)
        self.rank = self.global_ranks.index(dist.get_rank())
        # Every rank creates every group, in the same order, as torch.distributed requires.
        self._groups = {
            members: self.group if len(members) == world else dist.new_group([self.global_ranks[m] for m in members])
            for members in sets
        }
        self.overlap = dist.new_group(self.global_ranks) if overlap else None
        """All ranks again, for collectives that run while the engine reduces gradients on ``group``."""

    def of(self, members: tuple[int, ...]) -> Optional[dist.ProcessGroup]:
        """The process group of a rank set named by the plan."""
        return self._groups[members]

    def to_global(self, rank: int) -> int:
        return self.global_ranks[rank]
