"""Checkpoints that scale and are checked before anything loads (issue 14, items 7 and 11).

Single-process: every kind of corrupt K-FAC state is refused by ``load_state_dict`` with a
message naming what is wrong, and leaves the preconditioner bitwise as it was. One launch of
the real ``deepspeed`` launcher on 2 CPU ranks (``checkpoint_worker.py``): the bytes each rank
receives while the state is gathered for saving, and a checkpoint with a NaN in its K-FAC state
refused before DeepSpeed loads anything.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Callable

import launch
import pytest
import torch
from torch import nn

from ds_kfac import KFACPreconditioner

pytestmark = pytest.mark.timeout(300)

KEYS = {"damping": 0.01, "kl_clip": None, "factor_update_steps": 1, "inv_update_steps": "adaptive"}


def trained(seed: int) -> KFACPreconditioner:
    """Three steps on data of ``seed``: every entry of the state exists (factors, decompositions,
    both adaptive-refresh references of every factor)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    kfac = KFACPreconditioner(net, lr=0.0, **KEYS)
    g = torch.Generator().manual_seed(seed)
    for _ in range(3):
        net.zero_grad()
        ((net(torch.randn(8, 4, generator=g)) - torch.randn(8, 2, generator=g)) ** 2).mean().backward()
        kfac.step()
    return kfac


def contents(kfac: KFACPreconditioner) -> dict[str, Any]:
    """Copies of everything a load writes."""
    refresh = {
        key: (f.interval, f.previous_interval, f.next_step, f.refreshes, _copy(f.last), _copy(f.before_last))
        for key, f in kfac.refresh.factors.items()
    }
    return {
        "steps": kfac.steps,
        "counters": dict(kfac.counters),
        "pending": kfac.state.scalars.pending,
        "seen": set(kfac.state.scalars.seen),
        "refresh": refresh,
        "layers": {b.name: (_copy(b.a.value), _copy(b.g.value), _copy(b.decomposition)) for b in kfac.blocks},
    }


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return [_copy(v) for v in value]
    return value


def assert_same(a: Any, b: Any) -> None:
    """Equal, tensors bitwise (same dtype and bits)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    else:
        assert a == b


def _put(*path: Any, value: Any) -> Callable[[dict], None]:
    """Set ``state[path[0]]...[path[-1]] = value`` (``value`` may be a function of the old value)."""

    def corrupt(state: dict) -> None:
        parent = state
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = value(parent[path[-1]]) if callable(value) else value

    return corrupt


def _poison(number: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def poisoned(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[0] = number
        return t

    return poisoned


def _drop(key: str) -> Callable[[dict], None]:
    return lambda state: state.pop(key)


NAN, INF = float("nan"), float("inf")
CORRUPTIONS: dict[str, tuple[Callable[[dict], None], str]] = {
    "NaN in A": (_put("layers", "2", "A", value=_poison(NAN)), r"layer '2': A is not finite"),
    "infinity in G": (_put("layers", "0", "G", value=_poison(INF)), r"layer '0': G is not finite"),
    "NaN in eigenvalues": (
        _put("layers", "2", "state", 1, value=_poison(NAN)),
        r"layer '2': decomposition tensor 1 is not finite",
    ),
    "NaN in eigenvectors": (
        _put("layers", "0", "state", 2, value=_poison(NAN)),
        r"layer '0': decomposition tensor 2 is not finite",
    ),
    "NaN in a refresh reference": (
        _put("layers", "0", "A_refs", 1, value=_poison(NAN)),
        r"layer '0': A_refs\[1\] is not finite",
    ),
    "A of the wrong shape": (
        _put("layers", "0", "A", value=lambda t: t[:-1, :-1]),
        r"layer '0': A has shape \(4, 4\), expected \(5, 5\)",
    ),
    "G of the wrong shape": (
        _put("layers", "2", "G", value=torch.zeros(2, 3)),
        r"layer '2': G has shape \(2, 3\), expected \(2, 2\)",
    ),
    "reference of the wrong shape": (
        _put("layers", "2", "G_refs", 0, value=torch.zeros(3, 3)),
        r"layer '2': G_refs\[0\] has shape \(3, 3\), expected \(2, 2\)",
    ),
    "missing steps": (_drop("steps"), r"the state has no key 'steps'"),
    "negative steps": (_put("steps", value=-1), r"'steps' must be a non-negative int, got -1 \(int\)"),
    "float steps": (_put("steps", value=3.0), r"'steps' must be a non-negative int, got 3.0 \(float\)"),
    "integer A": (
        _put("layers", "0", "A", value=lambda t: t.long()),
        r"layer '0': A has dtype torch.int64, expected a floating-point dtype",
    ),
    "A as a list": (
        _put("layers", "2", "A", value=lambda t: t.tolist()),
        r"layer '2': A must be a tensor or None, got \[\[.*\(list\)",
    ),
    "decomposition as a dict": (
        _put("layers", "0", "state", value=lambda s: dict(enumerate(s))),
        r"layer '0': the decomposition must be None or a list of tensors",
    ),
    "counter not an int": (
        _put("counters", value={"skipped_steps": "2"}),
        r"counters\['skipped_steps'\] must be a non-negative int, got '2' \(str\)",
    ),
    "refresh schedule malformed": (
        _put("refresh", "0.A", value=[0, 1, 2]),
        r"refresh\['0.A'\] must be \[interval >= 1, previous_interval, next_step, refreshes\]",
    ),
    "pending decompositions malformed": (
        _put("pending_decompositions", value={"started": 2}),
        r"'pending_decompositions' must be None or \{'started': int, 'install_at': int\}",
    ),
    "pending decompositions after the step": (
        _put("pending_decompositions", value={"started": 3, "install_at": 4}),
        r"'pending_decompositions' .* does not fit steps=3 \(needs started < steps <= install_at\)",
    ),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_a_corrupt_state_is_refused_and_changes_nothing(case: str) -> None:
    """issue 14, item 7: ``load_state_dict`` checks the whole state first; a corrupt one raises one
    ``ValueError`` naming the layer/key and what is wrong, and nothing of it is written."""
    corrupt, message = CORRUPTIONS[case]
    state = copy.deepcopy(trained(seed=1).state_dict())
    corrupt(state)
    target = trained(seed=2)
    before = contents(target)
    with pytest.raises(ValueError, match=r"K-FAC state not loaded \(nothing was changed\): .*" + message):
        target.load_state_dict(state)
    assert_same(before, contents(target))


def test_every_problem_is_named_in_one_error() -> None:
    """issue 14, item 7: all problems of a state are reported together, not one per attempt."""
    state = copy.deepcopy(trained(seed=1).state_dict())
    for case in ("NaN in A", "A of the wrong shape", "negative steps"):
        CORRUPTIONS[case][0](state)
    with pytest.raises(ValueError) as refused:
        trained(seed=2).load_state_dict(state)
    for case in ("NaN in A", "A of the wrong shape", "negative steps"):
        assert re.search(CORRUPTIONS[case][1], str(refused.value)), case


# ----------------------------------------------------------------------- 2 ranks, one launch
WORKER = launch.WORKERS / "checkpoint_worker.py"
SCENARIOS = {
    "comm-opt": {"kfac": {"inv_update_steps": "adaptive"}},
    "mem-opt": {"ds": {"zero_optimization": {"stage": 2}}, "kfac": {"grad_worker_fraction": "mem-opt"}},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    out = tmp_path_factory.mktemp("checkpoints")
    scenarios = list(SCENARIOS.values()) + [{"ds": {"zero_optimization": {"stage": 2}}, "refused": str(out / "ckpt")}]
    results = launch.deepspeed_run(2, out, scenarios, worker=WORKER)
    return dict(zip([*SCENARIOS, "refused"], results))


def _slots(value: Any, n: int) -> list[Any]:
    """An entry as one slot per tensor (``None`` where absent)."""
    if value is None:
        return [None] * n
    return [value] if isinstance(value, torch.Tensor) else list(value)


@pytest.mark.parametrize("mode", list(SCENARIOS))
def test_saving_gathers_each_entry_once_to_the_saving_rank_only(runs, mode: str) -> None:
    """issue 14, item 11: while ``state_dict()`` gathers the state at 2 ranks, rank 1 (not the saver)
    receives nothing, and rank 0 receives exactly the tensors it does not hold itself (plus one
    presence byte per tensor), each equal to its holder's copy."""
    saver, other = runs[mode]
    assert other["state"] is None and other["bytes"] == {}
    expected_floats = expected_flags = 0
    for name, entry in saver["state"]["layers"].items():
        for key, value in entry.items():
            if key == "shape":
                continue
            assert value is not None, (name, key)  # every entry exists after 3 steps
            saved = _slots(value, 0)
            mine = _slots(saver["own"][name][key], len(saved))
            theirs = _slots(other["own"][name][key], len(saved))
            for t, held, elsewhere in zip(saved, mine, theirs):
                assert torch.equal(t, held if held is not None else elsewhere), (name, key)
                if held is None:
                    expected_floats += t.numel() * t.element_size()
                    expected_flags += 1
    assert expected_floats > 0  # rank 1 holds some of the state in both modes
    assert saver["bytes"] == {"float": expected_floats, "other": expected_flags}


def test_a_nan_checkpoint_is_refused_before_deepspeed_loads(runs) -> None:
    """issue 14, item 7: ``engine.load_checkpoint`` of a checkpoint whose saved K-FAC state holds a NaN
    raises naming the layer, on every rank, and leaves weights, optimizer state, step counters and
    K-FAC state as they were (ZeRO 2, 2 ranks). The same checkpoint with its good file loads."""
    for rank in runs["refused"]:
        assert "layer '2': A is not finite (NaN or infinity)" in rank["error"]
        assert rank["before"]["counters"][0] == 3  # trained a step past the checkpoint
        assert_same(rank["before"], rank["after"])
        assert rank["reloaded"]["counters"][0] == 2 and rank["reloaded"]["kfac"]["steps"] == 2


def test_a_truncated_state_file_is_named_and_refused(runs) -> None:
    """issue 30, item 5: the K-FAC state file cut to 99%, 90%, 50% and 10% of its size (a copy interrupted near its
    end; at some cuts torch raises only ``OSError: [Errno 22] Invalid argument``): every rank's error names the file
    and says it is truncated or corrupt, and the engine is as it was; the whole file then loads."""
    for rank in runs["refused"]:
        assert set(rank["truncated"]) == {0.99, 0.9, 0.5, 0.1}
        for cut, error in rank["truncated"].items():
            assert error is not None and re.search(
                r"ckpt/kfac_state\.pt \(\d+ bytes\) is truncated or corrupt", error
            ), (
                cut,
                error,
            )
        assert_same(rank["before"], rank["after_truncated"])
        assert rank["reloaded"]["kfac"]["steps"] == 2
