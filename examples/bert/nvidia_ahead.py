"""NVIDIA's files decompressed ahead of training: one process per rank reads the next file the rank will train on
while the current one trains (NVIDIA's loader does the same with a thread), into one uncompressed copy under
``/dev/shm`` that the rank's loader workers map, and drops each copy once training is past it.

A rank's files come in visits (a file in a round of an epoch, :meth:`nvidia.NvidiaOrder.visits`). The reader
writes a visit's arrays as ``.npy`` files into ``visit-<v>/`` (through a temporary name, so a directory that exists
is complete) as soon as the loader workers may have started on the visit before it, and removes a visit's copy
once the training has consumed all of its micro-batches (the loader makes a micro-batch before training takes it).
So shared memory holds the file being trained on, the next one, and what the workers' ``--prefetch`` reaches, not
the corpus. h5py holds the GIL while it decompresses, so a thread in a loader worker would stall that worker's
micro-batches: hence a process, started by the rank (loader workers are daemonic and may start none), forked as
the loader's workers are, so that it is ready at once.

A file that does not decompress leaves ``visit-<v>.error`` with the reason, which the worker waiting for it turns
into a fault naming the file (every rank stops, :mod:`faults`); a reader that died is found the same way. The
reader ends when its rank does, however it ends (it watches its parent), and its directory goes with it.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import numpy as np

ROOT = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
PREFIX = "ds_kfac_nvidia_"
POLL = 0.005


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: whether it exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def visit_path(directory: Path, visit: int) -> Path:
    return directory / f"visit-{visit}"


def remove_stale(root: Path = ROOT) -> None:
    """Directories of readers whose rank is gone (killed before it could remove its own)."""
    for path in root.glob(f"{PREFIX}*"):
        try:
            os.kill(int(path.name.removeprefix(PREFIX).split("_")[0]), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except (ValueError, PermissionError):
            continue


def _write_visit(directory: Path, visit: int, path: str) -> None:
    """The file's arrays, uncompressed, as ``visit-<v>/<key>.npy`` (or ``visit-<v>.error`` with the reason)."""
    import nvidia

    partial = directory / f".visit-{visit}.tmp"
    try:
        arrays = nvidia.read_file(path)
        partial.mkdir()
        for key, array in arrays.items():
            np.save(partial / f"{key}.npy", array)
        os.rename(partial, visit_path(directory, visit))
    except OSError as error:
        shutil.rmtree(partial, ignore_errors=True)
        (directory / f"visit-{visit}.error").write_text(str(error))


def _read_ahead(order: Any, directory: str, start: int, lead: int, consumed: Any, parent: int) -> None:
    """The reader's loop (in its own process): each visit from the one holding micro-batch ``start``, written once
    the visit before it may have begun in the workers (its first micro-batch within ``lead`` of ``consumed``)."""
    root, written = Path(directory), []  # (visit, its end)
    previous: Optional[int] = None  # the first micro-batch of the visit written last

    def drop() -> None:
        while written and written[0][1] <= consumed.value:
            shutil.rmtree(visit_path(root, written.pop(0)[0]), ignore_errors=True)

    for visit, index, first, end in order.visits(start):
        while previous is not None and previous > consumed.value + lead:
            if os.getppid() != parent:  # the rank is gone
                return
            drop()
            time.sleep(0.02)
        _write_visit(root, visit, order.files[index].path)
        written.append((visit, end))
        previous = first
        drop()


class Ahead:
    """A rank's reader process and its directory (see the module docstring); :meth:`count` passes the training's
    micro-batches through, counting them."""

    def __init__(self, order: Any, start: int, lead: int) -> None:
        remove_stale()
        self.directory = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}_", dir=ROOT))
        methods = multiprocessing.get_all_start_methods()  # forked: started at once (spawned: 2 s of imports first)
        context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
        self.consumed = context.RawValue("q", start)
        args = (order, str(self.directory), start, lead, self.consumed, os.getpid())
        self.process = context.Process(target=_read_ahead, args=args, daemon=True)
        self.process.start()

    @property
    def shared(self) -> tuple[str, int]:
        """What a loader worker needs: the directory and the reader's process id."""
        return str(self.directory), int(self.process.pid)

    def count(self, batches: Iterator[Any]) -> Iterator[Any]:
        """``batches``, each counted as consumed once training has it; the reader stopped when they end."""
        try:
            for batch in batches:
                yield batch
                self.consumed.value += 1
        finally:
            self.close()

    def close(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=10)
        shutil.rmtree(self.directory, ignore_errors=True)


def wait_for(directory: str, reader: int, visit: int, path: str) -> dict[str, np.ndarray]:
    """Visit ``visit``'s arrays (mapped: one copy per rank), waiting for the reader; an ``OSError`` naming the file
    where it could not be read or the reader died."""
    done, error = visit_path(Path(directory), visit), Path(directory) / f"visit-{visit}.error"
    checked = time.monotonic()
    while not done.is_dir():
        if error.is_file():
            raise OSError(error.read_text())
        if time.monotonic() - checked > 1.0:
            checked = time.monotonic()
            if not alive(reader) and not done.is_dir():
                raise OSError(f"{path}: the reader of NVIDIA's files (process {reader}) died before reading it")
        time.sleep(POLL)
    return {file.stem: np.load(file, mmap_mode="r") for file in done.glob("*.npy")}
