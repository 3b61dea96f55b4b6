"""Run a worker script under the real ``deepspeed`` (or ``torchrun``) launcher.

Every launch gets a free loopback port and a timeout, runs in its own process
session, and is killed with all its children if it overruns, so no test
leaves processes or ports behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import torch

WORKERS = Path(__file__).parent / "workers"
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd: list[str], timeout: float, env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess:
    """Run ``cmd`` in a new session; on timeout kill the whole process group."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"timed out after {timeout}s: {' '.join(cmd)}\n{out[-6000:]}") from None
    if proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}: {' '.join(cmd)}\n{out[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def deepspeed_run(
    world: int, out_dir: Path, scenarios: list[dict[str, Any]], timeout: float = 240
) -> list[list[dict[str, Any]]]:
    """Run ``workers/ds_worker.py`` on ``world`` CPU ranks; return each scenario's per-rank results."""
    spec = out_dir / "scenarios.json"
    spec.write_text(json.dumps(scenarios))
    cmd = [str(BIN / "deepspeed"), "--num_gpus", str(world), "--master_port", str(free_port())]
    run(cmd + [str(WORKERS / "ds_worker.py"), "--spec", str(spec), "--out", str(out_dir)], timeout)
    return [[torch.load(out_dir / f"{i}_rank{r}.pt") for r in range(world)] for i in range(len(scenarios))]
