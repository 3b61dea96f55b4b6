"""NVIDIA's files read ahead (``examples/bert/nvidia_ahead.py``): a reader process per rank decompresses the next
file while the current one trains, into one shared copy that the loader workers map, drops each copy once training
is past it, and turns a file that does not decompress, or its own death, into a fault naming the file."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(120)
h5py = pytest.importorskip("h5py")

sys.path.insert(0, str(Path(__file__).parents[1] / "examples/bert"))
import nvidia  # noqa: E402
import nvidia_ahead  # noqa: E402
from test_bert_faults import corrupt_chunk  # noqa: E402
from test_bert_shards import SEQ, write_nvidia_shard  # noqa: E402


@pytest.fixture
def files(tmp_path: Path) -> list[nvidia.File]:
    for i, rows in enumerate([24, 40, 16, 32]):
        write_nvidia_shard(tmp_path / f"x_training_{i}.hdf5", rows, SEQ, 10, 600, i)
    return nvidia.discover(tmp_path, SEQ)[0]


def visits_on_disk(ahead: nvidia_ahead.Ahead) -> list[int]:
    return sorted(int(p.name.removeprefix("visit-")) for p in ahead.directory.glob("visit-*") if p.is_dir())


def wait_until(condition, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_reader_keeps_the_visit_in_training_and_the_next_and_drops_the_rest(files) -> None:
    """Each visit's copy holds the file's arrays as stored; with nothing consumed the reader writes the first visit
    and the one after it (it may begin within the lead) and no more; as training consumes micro-batches it writes
    the next and removes each visit whose micro-batches were all consumed; closed, its directory is gone."""
    order = nvidia.NvidiaOrder(files, 8, 1, 1, 0, seed=5)
    walk = order.visits(0)
    plan = [next(walk) for _ in range(6)]  # (visit, file, its first micro-batch, the one after its last)
    lead = 2
    # written with nothing consumed: the first visit, then each whose predecessor begins within the lead
    expected = [plan[0][0]] + [v[0] for k, v in enumerate(plan[1:]) if all(p[2] <= lead for p in plan[: k + 1])]
    ahead = nvidia_ahead.Ahead(order, 0, lead)
    try:
        wait_until(lambda: visits_on_disk(ahead) == expected)
        time.sleep(0.3)
        assert visits_on_disk(ahead) == expected  # nothing further ahead while nothing is consumed
        directory, pid = ahead.shared
        arrays = nvidia_ahead.wait_for(directory, pid, plan[0][0], files[plan[0][1]].path)
        stored = nvidia.read_file(files[plan[0][1]].path)
        assert all(np.array_equal(arrays[key], stored[key]) for key in nvidia.KEYS)
        ahead.consumed.value = plan[2][2]  # training reached the third visit
        wait_until(lambda: plan[0][0] not in visits_on_disk(ahead) and plan[3][0] in visits_on_disk(ahead))
        assert plan[1][0] not in visits_on_disk(ahead) and plan[2][0] in visits_on_disk(ahead)
    finally:
        ahead.close()
    assert not ahead.directory.exists() and not ahead.process.is_alive()


def test_a_corrupt_file_or_a_dead_reader_is_an_error_naming_the_file(files) -> None:
    order = nvidia.NvidiaOrder(files, 8, 1, 1, 0, seed=5)
    first = next(order.visits(0))
    corrupt_chunk(Path(files[first[1]].path))
    ahead = nvidia_ahead.Ahead(order, 0, lead=2)
    try:
        with pytest.raises(OSError, match=rf"{files[first[1]].path}: cannot read its arrays"):
            nvidia_ahead.wait_for(*ahead.shared, first[0], files[first[1]].path)
        os.kill(ahead.process.pid, signal.SIGKILL)
        ahead.process.join()
        started = time.monotonic()
        with pytest.raises(OSError, match=r"x_training_\d\.hdf5: the reader of NVIDIA's files \(process \d+\) died"):
            nvidia_ahead.wait_for(*ahead.shared, 10**6, files[0].path)
        assert time.monotonic() - started < 5
    finally:
        ahead.close()


def test_a_killed_ranks_directory_is_removed_by_the_next_reader(tmp_path: Path) -> None:
    """A rank killed outright cannot remove its reader's directory: the next reader started on the machine does,
    and leaves those of ranks alive."""
    dead = nvidia_ahead.ROOT / f"{nvidia_ahead.PREFIX}{2**22 + 12345}_x"  # no such process
    live = nvidia_ahead.ROOT / f"{nvidia_ahead.PREFIX}{os.getpid()}_y"
    for path in (dead, live):
        path.mkdir()
    try:
        nvidia_ahead.remove_stale()
        assert not dead.exists() and live.exists()
    finally:
        live.rmdir()
