"""What one rank does under a placement plan: which layers it collects, decomposes, stores and preconditions.

:class:`RankRoles` answers every "does this rank ..." question for any data-parallel rank of any world size, with
no process group (so :mod:`ds_kfac.planning` can ask it for every rank before launch); :class:`Roles` is this
process's rank, with the process groups the plan needs. The classes that move data
(:mod:`~ds_kfac.placement.factors`, :mod:`~ds_kfac.placement.decompositions`,
:mod:`~ds_kfac.placement.distributor`) build on it.
"""

from __future__ import annotations

from typing import Optional, Sequence

from torch.distributed import ProcessGroup

from ..comm import RankGroups, data_parallel_rank, data_parallel_world
from ..config import KFACConfig, KFACConfigError
from ..curvature import CurvatureBlock
from .plan import PlacementPlan


class RankRoles:
    """Rank ``rank`` of ``world`` data-parallel ranks under the plan of ``blocks``: no process group, no
    communication."""

    def __init__(
        self,
        blocks: Sequence[CurvatureBlock],
        config: KFACConfig,
        world: int,
        rank: int,
        holders: Optional[dict[str, tuple[int, ...]]] = None,
        plan: Optional[PlacementPlan] = None,
    ) -> None:
        """``plan``: the same job's plan, built for another rank (it is every rank's: the planner builds it once)."""
        self.config = config
        self.holders = holders
        """The ranks whose ZeRO partitions hold each layer's gradient (``None``: every rank holds every gradient)."""
        self.world = world
        self.rank = rank
        # Blocks are their own placement shapes (a name and each side's cost); blocks with one side are colocated.
        colocate = config.factor_reduction == "local" or any(b.colocated for b in blocks if len(b.sides) > 1)
        self.plan = plan or PlacementPlan(
            blocks, self.world, config.grad_worker_fraction, config.assignment, colocate, holders
        )
        self.reduces = self.world > 1 and config.factor_reduction != "local"
        """Whether factors are reduced over ranks (not ``local``, more than one rank)."""
        self.overlap = self.reduces and config.overlap_factor_comm
        self.bases_everywhere = config.eigenvalue_correction and self.reduces and not self.plan.replicated
        """Whether every rank holds every decomposition: it projects its examples' gradients on the eigenbases."""
        self._refuse_local_correction()
        self._blocks = {b.name: b for b in blocks}

    @property
    def shares_along_rows(self) -> bool:
        """Whether gradient workers broadcast ``P(g)`` along rows to the ranks that are not (fewer gradient workers
        than ranks) where every rank holds every gradient (under ZeRO's partitions each rank writes what it holds)."""
        return self.world > 1 and not self.plan.replicated

    def broadcast_sets(self) -> list[tuple[int, ...]]:
        """The rank sets that exchange decompositions or gradients, each of which needs a process group."""
        return self.plan.broadcast_sets() + ([tuple(range(self.world))] if self.bases_everywhere else [])

    def _refuse_local_correction(self) -> None:
        """With ``factor_reduction: "local"`` a layer's owner computes ``S`` from its own examples and sends it
        nowhere, so the layer must have no other gradient worker."""
        if not (self.config.eigenvalue_correction and self.config.factor_reduction == "local"):
            return
        shared = sorted(name for name, p in self.plan.layers.items() if len(p.grad_workers) > 1)
        if shared:
            raise KFACConfigError(
                f'kfac.eigenvalue_correction with kfac.factor_reduction="local" needs one gradient worker per layer '
                f'(grad_worker_fraction="mem-opt", no layer split between ZeRO partitions): the owner computes S '
                f"from its own examples and does not send it, yet layers {shared} have several gradient workers"
            )

    def collects(self, block: CurvatureBlock) -> bool:
        """Whether this rank's hooks compute the layer's factors (``local``: its owner only)."""
        return self.config.factor_reduction != "local" or self.rank == self.plan.layers[block.name].a_worker

    def is_grad_worker(self, block: CurvatureBlock) -> bool:
        return self.plan.is_grad_worker(block.name, self.rank)

    def grad_workers(self, block: CurvatureBlock) -> tuple[int, ...]:
        """The data-parallel ranks that precondition the layer."""
        return self.plan.layers[block.name].grad_workers

    def preconditioners(self, block: CurvatureBlock) -> tuple[int, ...]:
        """The ranks that precondition the layer, and so keep its eigenbasis moments: its gradient workers that hold
        (some of) its gradient; without ZeRO's partitions, all its gradient workers."""
        workers = self.grad_workers(block)
        if self.holders is None:
            return workers
        return tuple(r for r in workers if r in self.holders[block.name])

    def decomposition_holders(self, block: CurvatureBlock) -> tuple[int, ...]:
        """The data-parallel ranks that hold the layer's decomposition: its gradient workers, or every rank
        (:attr:`bases_everywhere`)."""
        return tuple(range(self.world)) if self.bases_everywhere else self.grad_workers(block)

    def holds_decomposition(self, block: CurvatureBlock) -> bool:
        return self.rank in self.decomposition_holders(block)

    def decomposer(self, name: str, side: str) -> int:
        """The rank that decomposes statistic ``side`` of layer ``name``: the placement's ``a_worker`` for the
        block's first side, its ``g_worker`` for a second."""
        placement = self.plan.layers[name]
        return placement.a_worker if side == self._blocks[name].sides[0] else placement.g_worker

    def decomposes(self, name: str, side: str) -> bool:
        """Whether this rank decomposes factor ``side`` of layer ``name`` (and so tracks its refresh)."""
        return self.rank == self.decomposer(name, side)

    def stores_factor(self, block: CurvatureBlock, side: str) -> bool:
        """Whether this rank stores the running statistic ``side`` ("A", "G", "S") of the layer."""
        return self.rank in self._factor_stores(block.name, side)

    def _factor_stores(self, name: str, side: str) -> tuple[int, ...]:
        """The ranks storing the running statistic ``side`` of layer ``name`` (``S``: the gradient workers)."""
        if self.config.factor_reduction == "allreduce" or side not in self._blocks[name].sides:
            return self.plan.layers[name].grad_workers
        return (self.decomposer(name, side),)

    def counts_in_kl_sum(self, block: CurvatureBlock) -> bool:
        """Exactly one rank adds each layer to the KL-clip sum (all of them when all hold all)."""
        return self.plan.replicated or self.rank == self.plan.layers[block.name].a_worker


class Roles(RankRoles):
    """This process's roles under the plan of ``blocks`` (built identically on every rank; creating its process
    groups is collective over ``group``)."""

    def __init__(
        self,
        blocks: Sequence[CurvatureBlock],
        config: KFACConfig,
        group: Optional[ProcessGroup],
        bucket_bytes: int,
        holders: Optional[dict[str, tuple[int, ...]]] = None,
    ) -> None:
        super().__init__(blocks, config, data_parallel_world(group), data_parallel_rank(group), holders)
        self.group = group
        self.bucket_bytes = bucket_bytes
        self.groups = RankGroups(self.broadcast_sets(), group, self.overlap) if self.world > 1 else None

    def _decomposer_global(self, block: CurvatureBlock, side: str) -> int:
        """The global rank of :meth:`decomposer` (the source or destination of a collective)."""
        return self.groups.to_global(self.decomposer(block.name, side))
