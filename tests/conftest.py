"""Fixtures shared by the test modules."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import launch
import pytest
import torch

import ds_kfac

# One intra-op thread in the pytest process, as every launched rank has (tests/launch.py): the tests' ops are too
# small to share, and on a machine whose cores are busy with anything else two OpenMP threads waiting on each other at
# every op's barrier cost 10-100x (issue 48: the GPU bundle's hooks check, 0.25 s alone, took 11-43 s in this process
# beside two busy loops with two threads, 0.5 s with one).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _torch_linear_restored() -> Iterator[None]:
    """``torch.nn.functional.linear`` as it was before the test: a ZeRO 3 engine built in this process replaces it
    for good with DeepSpeed's autograd Function (DeepSpeed says so: "This will persist unless manually reset")."""
    linear = torch.nn.functional.linear
    yield
    torch.nn.functional.linear = linear


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The launcher's environment for one rank in this process; the process group is shut down afterwards."""
    for key, value in launch.one_rank_env().items():
        monkeypatch.setenv(key, value)
    # TrainingArguments(deepspeed=...) sets this in os.environ for good; restored (unset) after the test, so a later
    # Trainer built without DeepSpeed is not taken for a DeepSpeed one.
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")
    yield
    ds_kfac.shutdown()


@pytest.fixture
def engines(one_rank: None) -> Iterator[list[Any]]:
    """Engines a test builds on one rank, destroyed afterwards (which restores Python's GC if they disabled it)."""
    built: list[Any] = []
    yield built
    for engine in built:
        engine.destroy()


EASGD_JOB = ("test_easgd", "test_ranks")
"""The modules (test_easgd.py, robustness/test_ranks.py) whose scenarios share one 2-rank launch of
``robustness/ranks_worker.py`` (it runs easgd_worker's scenarios and its own), each providing ``job_scenarios(out)``;
test_ranks's refusals come last."""


@pytest.fixture(scope="session")
def easgd_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """One launch's start-up instead of one per module: the scenarios of those :data:`EASGD_JOB` modules this
    session imported (collected), in that order; per module (by ``__name__``), each scenario's per-rank results."""
    out = tmp_path_factory.mktemp("easgd_job")
    parts = {}
    for name in EASGD_JOB:
        module = sys.modules.get(name)
        if module is not None:
            parts[module.__name__] = module.job_scenarios(out / module.__name__)
    scenarios = [s for part in parts.values() for s in part.values()]
    worker = Path(__file__).parent / "robustness" / "ranks_worker.py"
    results = iter(launch.deepspeed_run(2, out, scenarios, worker=worker, timeout=280))
    return {name: {key: next(results) for key in part} for name, part in parts.items()}


_STARTED: list[float] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    _STARTED.append(time.monotonic())


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Where the session's time went (issue 48): its launches (:data:`launch.LEDGER`), their start-up (until every
    process of a launch had printed its first line: for a fresh worker once torch and DeepSpeed are imported, for a
    preloaded one at its first work) and the ten longest."""
    ledger = launch.LEDGER
    if not ledger or not _STARTED:
        return
    session = time.monotonic() - _STARTED[0]
    firsts = sorted(f for e in ledger for f in e.first_output if f is not None)
    write = terminalreporter.write_line
    terminalreporter.section("launches")
    write(
        f"{len(ledger)} launches of {sum(e.processes for e in ledger)} processes: "
        f"{sum(e.seconds for e in ledger):.1f} s of the session's {session:.1f} s, of which start-up "
        f"{sum(e.startup for e in ledger if e.startup is not None):.1f} s; a process's first line after "
        f"{statistics.median(firsts):.2f} s (median, {firsts[0]:.2f}-{firsts[-1]:.2f})"
        if firsts
        else f"{len(ledger)} launches, none printed"
    )
    for e in sorted(ledger, key=lambda e: -e.seconds)[:10]:
        startup = "   -   " if e.startup is None else f"{e.startup:5.2f} s"
        write(f"{e.seconds:7.2f} s, {e.processes} processes, start-up {startup}  {e.test}")
