"""A start-up that never hangs silently (issue 30, item 4): a stale torch build lock of DeepSpeed's CPU communication
op is named within seconds, a build in progress is waited for, and the project's commands use an extensions directory
of their own."""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from pathlib import Path

import launch
import pytest

from ds_kfac.integration.extensions import build_lock, building_in, refuse_stale_build_locks

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).parents[2]


def _plant_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = build_lock("ShareMemCommBuilder")
    assert lock == tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    return lock


def _age(lock: Path, seconds: float) -> None:
    """Make ``lock`` look written ``seconds`` ago (its modification time)."""
    then = time.time() - seconds
    os.utime(lock, (then, then))


def test_a_stale_lock_is_named_within_the_grace_period(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lock just written waits out the grace period (torch holds a live one for milliseconds), then is named."""
    lock = _plant_lock(tmp_path, monkeypatch)
    started = time.monotonic()
    path = re.escape(str(lock))
    with pytest.raises(RuntimeError, match=rf"{path} exists but no process is building .*\(rm {path}\)"):
        refuse_stale_build_locks(grace=0.5)
    assert 0.5 <= time.monotonic() - started < 5


@pytest.mark.parametrize("age, waits", [(3600.0, 0.0), (0.75, 0.75), (-3600.0, 1.5)], ids=["old", "young", "future"])
def test_the_locks_age_counts_toward_the_grace_period(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, age: float, waits: float
) -> None:
    """The grace counts from the lock's modification time: an hour-old lock is named at once, one written 0.75 s ago
    after the rest of a 1.5 s grace; one dated in the future (a clock that disagrees) after the whole grace."""
    lock = _plant_lock(tmp_path, monkeypatch)
    _age(lock, age)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="exists but no process is building"):
        refuse_stale_build_locks(grace=1.5)
    assert waits <= time.monotonic() - started < waits + 0.7


def test_a_build_in_progress_is_waited_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process working in the op's directory (as ninja and the compiler do) holds off the verdict, past the grace
    period, until the lock goes."""
    lock = _plant_lock(tmp_path, monkeypatch)
    builder = subprocess.Popen(["sleep", "3"], cwd=lock.parent)
    try:
        assert building_in(lock.parent) and not building_in(tmp_path)
        threading.Timer(2.0, lock.unlink).start()
        started = time.monotonic()
        refuse_stale_build_locks(grace=0.5)
        assert 1.5 < time.monotonic() - started < 10
    finally:
        builder.kill()
        builder.wait()


def test_a_launch_with_a_stale_lock_fails_with_the_message(tmp_path: Path) -> None:
    """The real launcher, 2 ranks: with a stale lock (a minute old) planted in the extensions directory, every rank
    stops at ``ds_kfac.init_distributed`` with the message (before, DeepSpeed's start-up waited forever)."""
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.touch()
    _age(lock, 60.0)
    spec = tmp_path / "spec.json"
    spec.write_text("[]")
    cmd = [str(launch.BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(launch.free_port())]
    cmd += [str(launch.WORKERS / "ds_worker.py"), "--spec", str(spec), "--out", str(tmp_path)]
    started = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        launch.run([cmd], timeout=90, env={"TORCH_EXTENSIONS_DIR": str(tmp_path)})
    assert time.monotonic() - started < 60
    # The ranks' tracebacks share one pipe and interleave write by write (once in 9 runs of the suite: "RuntimeError"
    # "RuntimeError" ": " ": "), so the type and the message are matched apart; the message is one write, whole.
    output = str(failed.value)
    assert "RuntimeError" in output and f"{lock} exists but no process is building" in output


def test_the_makefile_gives_the_venv_its_own_extensions_directory() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert "export TORCH_EXTENSIONS_DIR := $(CURDIR)/$(VENV)/torch_extensions" in makefile
