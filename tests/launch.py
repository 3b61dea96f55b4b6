"""Run worker scripts on several ranks: as the ``deepspeed`` launcher starts them, or under the real launchers.

:func:`deepspeed_run` and :func:`torchrun` start each rank's process directly, with the environment and arguments
the ``deepspeed`` launcher (``deepspeed.launcher.launch``) or ``torchrun`` gives it: the launcher's own two
processes cost about 6 s of a launch on 2 cores and are not what those tests are about. The launchers themselves are
run for real by :func:`deepspeed_nodes`, :func:`torchrun_two_nodes`, the stale-lock test and test_time_to_target's
test of the benchmarks' ``launch``.

Those ranks (``run(..., preload=True)``) are forked from a server process that imported torch, DeepSpeed and
ds_kfac once (:class:`Forked`): each is still a process of its own with its own process group, but skips the 1.7 s of
imports every fresh interpreter pays (issue 48). Processes whose start is the subject (the launchers, interpreter
exit, the extension build) start fresh.

Every launch gets a loopback port and a timeout, runs in its own process
session, and is killed with all its children if it overruns, so no test
leaves processes or ports behind. Ranks started here meet at a store this
process serves on a port it holds from before they learn it (:func:`held_port`);
a real launcher binds a free port it is given (:func:`free_port`) itself.
"""

from __future__ import annotations

import atexit
import io
import json
import multiprocessing
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist

from ds_kfac.integration.cleanup import port_segments, release_port_segments

WORKERS = Path(__file__).parent / "workers"
BIN = Path(sys.executable).parent


_GIVEN: set[int] = set()
"""Every port :func:`free_port` has returned in this process."""


def free_port() -> int:
    """A free loopback port, never one returned before in this process: launches started side by side, each asking
    for a port before any binds it, get different ones."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


_HELD: dict[int, dist.TCPStore] = {}
"""The stores :func:`held_port` serves, by port, until :func:`release`."""


def held_port() -> int:
    """A loopback port on which this process serves a job's ``TCPStore`` until :func:`release`: the job's ranks
    join it as clients (``TORCHELASTIC_USE_AGENT_STORE=True``, as under torchrun's agent). The port is bound before
    any rank learns it: one found free and closed again (:func:`free_port`) can meanwhile become another socket's
    ephemeral port (a gloo connection's, say), and the job's rank 0 then fails to bind it."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    _HELD[store.port] = store
    return store.port


def release(port: str | int) -> None:
    """The end of a job that met at ``port``: its store (:func:`held_port`) is stopped, its port closed, and its
    DeepSpeed shared-memory segments are removed."""
    _HELD.pop(int(port), None)
    release_port_segments(port)


def one_rank_env() -> dict[str, str]:
    """The launcher's environment for a single rank on a free loopback port."""
    return {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }


def run(
    cmds: list[list[str]],
    timeout: float,
    env: Optional[dict[str, str]] = None,
    left_segments: Optional[list[Path]] = None,
    rank_envs: Optional[list[dict[str, str]]] = None,
    preload: bool = False,
) -> list[str]:
    """Run ``cmds`` concurrently, each in a new session (``rank_envs``: each its own variables besides ``env``);
    return their outputs. If any fails or the time runs out, every process group is killed. Afterwards the launch's
    ports (``--master_port`` or ``MASTER_PORT``) are released (:func:`release`), their DeepSpeed shared-memory
    segments included (see :mod:`ds_kfac.integration.cleanup`): a killed rank cannot remove its own. Those segments
    found are first appended to ``left_segments``, when given. ``preload``: every command is ``python -u SCRIPT
    ARGS`` (as :func:`rank_launch` makes them), each forked with the imports done (:class:`Forked`)."""
    return [out for out, _, _ in _released(cmds, timeout, env, left_segments, rank_envs, preload, True)]


@dataclass(frozen=True)
class Ended:
    """How one process of :func:`outcomes` ended: its exit code, its output, and its seconds from the launch."""

    code: int
    output: str
    seconds: float


def outcomes(
    cmds: list[list[str]], timeout: float, rank_envs: Optional[list[dict[str, str]]] = None, preload: bool = False
) -> list[Ended]:
    """As :func:`run`, but a process that fails does not end the others: every one is waited for (until
    ``timeout``, then all are killed and it fails) and how each ended is returned: the tests of how every rank stops
    on its own."""
    ended = _released(cmds, timeout, None, None, rank_envs, preload, False)
    return [Ended(code, out, seconds) for out, code, seconds in ended]


def _released(
    cmds: list[list[str]],
    timeout: float,
    env: Optional[dict[str, str]],
    left_segments: Optional[list[Path]],
    rank_envs: Optional[list[dict[str, str]]],
    preload: bool,
    check: bool,
) -> list[tuple[str, int, float]]:
    """:func:`_run`, then the launch's ports released (:func:`run`)."""
    ports = {cmd[cmd.index("--master_port") + 1] for cmd in cmds if "--master_port" in cmd}
    ports |= {e["MASTER_PORT"] for e in rank_envs or [] if "MASTER_PORT" in e}
    try:
        return _run(cmds, timeout, env, rank_envs or [{} for _ in cmds], preload, check)
    finally:
        for port in ports:
            if left_segments is not None:
                left_segments.extend(port_segments(port))
            release(port)


@dataclass(frozen=True)
class Launch:
    """One :func:`run`: the test that made it, its processes, its wall seconds, and per process the seconds until
    its first line of output (a fresh Python process with torch and DeepSpeed imported prints DeepSpeed's
    accelerator line first: the start-up a launch pays before any work; a preloaded rank, its imports done, prints
    its first line of work)."""

    test: str
    processes: int
    seconds: float
    first_output: tuple[Optional[float], ...]  # None: the process printed nothing

    @property
    def startup(self) -> Optional[float]:
        """Seconds until every process had printed its first line (``None`` if one printed nothing)."""
        return None if None in self.first_output else max(self.first_output, default=None)


LEDGER: list[Launch] = []
"""Every launch this process ran, in order (the suite's summary reports them: tests/conftest.py)."""


PRELOADED = (
    *("torch", "deepspeed", "ds_kfac"),
    *("torch._dynamo", "deepspeed.runtime.zero.muon.muon_optimizer", "torch.utils.cpp_extension"),
    *("megatron.core.tensor_parallel", "transformers.models.bert.modeling_bert"),
    *("sklearn.datasets", "sklearn.model_selection"),
)
"""What the server of :class:`Forked` imports once, in a fresh interpreter's order (ds_kfac before the libraries it
reads in ``sys.modules``): the workers' first imports; those every rank building an optimizer or an engine makes on
the way (``torch.optim.Optimizer`` imports ``torch._dynamo``, ``deepspeed.initialize`` checks the optimizer against
DeepSpeed's Muon, whose ``torch.compile`` decorators import the compiler's configuration, and ds_kfac's build lock
imports torch's extension builder: 1.4 s of each rank's CPU on 2 cores, as much again as the first three); and the
libraries of the Megatron, Hugging Face and digits workers and examples (0.3-1 s each). ds_kfac reads megatron's
presence only to register its layers' adapters, which a model without them never uses; whether ``import ds_kfac``
imports any of them is tested in fresh interpreters."""

_FRESH_PATHS: dict[tuple, list[str]] = {}
"""``sys.path`` of a fresh interpreter after its script's directory, per working directory and ``PYTHON*``
variables (read once each, by :func:`_fresh_path`)."""


def _fresh_path(env: dict[str, str], cwd: str) -> list[str]:
    """What a fresh interpreter started in ``cwd`` with ``env`` puts on ``sys.path`` after its script's directory:
    ``PYTHONPATH`` (its relative entries taken from ``cwd``), the standard library, site-packages."""
    key = (cwd, *sorted((k, v) for k, v in env.items() if k.startswith("PYTHON")))
    if key not in _FRESH_PATHS:
        code = "import json, sys; print(json.dumps(sys.path[1:]))"
        fresh = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60, env=env, cwd=cwd
        )
        _FRESH_PATHS[key] = json.loads(fresh.stdout)
    return _FRESH_PATHS[key]


def _exec_script(argv: list[str], env: dict[str, str], cwd: str, path: list[str], out: Connection) -> None:
    """In a process forked from the preloaded server: become what ``python -u ARGV`` started in ``cwd`` with ``env``
    would be (its own session, output to ``out``, the environment, directory, ``sys.argv``, ``sys.path``,
    ``OMP_NUM_THREADS`` threads and the platform's multiprocessing start method, not the server's ``forkserver``:
    a DataLoader worker is forked as under the launcher), run the script as ``__main__``, then end as the
    interpreter would: a traceback and exit 1 on an exception, else ``SystemExit``'s code; the threads shut down as
    the interpreter shuts them down (``concurrent.futures`` executors told to stop, then every non-daemon thread
    joined), the ``atexit`` handlers run."""
    os.setsid()
    for fd in (1, 2):
        os.dup2(out.fileno(), fd)
    out.close()
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    multiprocessing.set_start_method(None, force=True)
    sys.argv = list(argv)
    sys.path[:] = [str(Path(argv[0]).parent), *path]
    code = 0
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:  # a message
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 (reported as the interpreter reports it)
        traceback.print_exc()
        code = 1
    threading._shutdown()  # the interpreter's own: its thread-exit hooks (an executor's workers), then the joins
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def check_preloadable(cmd: list[str]) -> None:
    """Refuse a command :class:`Forked` cannot start: only ``python -u SCRIPT ...`` with this interpreter."""
    if cmd[:2] != [sys.executable, "-u"] or len(cmd) < 3:
        raise ValueError(f"a preloaded rank runs `{sys.executable} -u SCRIPT ...`, not {cmd}")


class Forked:
    """A rank forked from a ``forkserver`` process that imported :data:`PRELOADED` once (the first launch starts it;
    it lives as long as this process), with the part of ``subprocess.Popen``'s interface :func:`run` uses."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        """``cmd``: as :func:`check_preloadable` accepts (:func:`run` checks every command before any starts)."""
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(list(PRELOADED))
        reader, writer = context.Pipe(duplex=False)
        self.args = cmd
        cwd = os.getcwd()
        self._process = context.Process(target=_exec_script, args=(cmd[2:], env, cwd, _fresh_path(env, cwd), writer))
        self._process.start()
        writer.close()
        self.pid = self._process.pid
        self.stdout = os.fdopen(os.dup(reader.fileno()), "r")
        reader.close()

    @property
    def returncode(self) -> Optional[int]:
        return self._process.exitcode

    def poll(self) -> Optional[int]:
        return self._process.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self._process.exitcode


def leftovers() -> list[int]:
    """Live processes this process's launches left: its children, except the fork server of :class:`Forked` and
    multiprocessing's resource tracker (servers for the session), and that server's children (forked ranks)."""
    live: dict[int, tuple[int, bool]] = {}  # pid: (parent, a multiprocessing server)
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
            server = b"from multiprocessing." in (status.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if not fields.get("State", "").startswith("Z"):
            live[int(status.parent.name)] = (int(fields["PPid"]), server)
    me = os.getpid()
    servers = {pid for pid, (parent, server) in live.items() if parent == me and server}
    return [pid for pid, (parent, _) in live.items() if (parent == me and pid not in servers) or parent in servers]


def _kill(proc: Union[subprocess.Popen, Forked]) -> None:
    """Kill ``proc``'s session (a forked rank killed before it made its own: the rank alone)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)


def _read(proc: Union[subprocess.Popen, Forked], started: float, first: list[float], lines: list[str]) -> None:
    """Collect ``proc``'s output until it closes, noting when its first line came."""
    with proc.stdout:
        for line in proc.stdout:
            if not lines:
                first.append(time.monotonic() - started)
            lines.append(line)


def _run(
    cmds: list[list[str]],
    timeout: float,
    env: Optional[dict[str, str]],
    rank_envs: list[dict[str, str]],
    preload: bool,
    check: bool,
) -> list[tuple[str, int, float]]:
    """Each process's (output, exit code, seconds to its end); ``check``: the first failure kills the others and
    raises."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    for cmd in cmds if preload else []:
        check_preloadable(cmd)  # before any starts
    started = time.monotonic()
    procs = [
        Forked(cmd, {**full_env, **own})
        if preload
        else subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**full_env, **own},
            start_new_session=True,
        )
        for cmd, own in zip(cmds, rank_envs)
    ]
    firsts: list[list[float]] = [[] for _ in procs]
    lines: list[list[str]] = [[] for _ in procs]
    readers = [threading.Thread(target=_read, args=(p, started, f, o)) for p, f, o in zip(procs, firsts, lines)]
    for reader in readers:
        reader.start()
    deadline = started + timeout
    failure, failed = None, None
    ended = [0.0 for _ in procs]
    try:
        pending = list(range(len(procs)))
        while pending and failure is None and failed is None:  # in the order they end
            for i in list(pending):
                if procs[i].poll() is not None:
                    ended[i] = time.monotonic() - started
                    pending.remove(i)
                    if check and procs[i].returncode != 0:
                        failed = procs[i]
                        break
            if pending and time.monotonic() > deadline:
                failure = f"timed out after {timeout}s: {' '.join(cmds[pending[0]])}"
            elif pending and failed is None:
                time.sleep(0.05)
    finally:
        for proc, reader in zip(procs, readers):
            if proc.poll() is None:
                _kill(proc)
                proc.wait()
            reader.join(timeout=max(1.0, deadline - time.monotonic()))
            if reader.is_alive():  # a child of the process still holds its output open: its group goes too
                failure = failure or f"a child outlived the process and held its output: {' '.join(proc.args)}"
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:  # the child left the group: what it still writes is not read
                    pass
                reader.join(timeout=5.0)
    outputs = ["".join(out) for out in lines]
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    first = tuple(f[0] if f else None for f in firsts)
    LEDGER.append(Launch(test, len(procs), time.monotonic() - started, first))
    if failed is not None and failure is None:
        failure = f"exit {failed.returncode}: {' '.join(failed.args)}\n{outputs[procs.index(failed)][-6000:]}"
    elif failure and failure.startswith("timed out"):  # where each process was: its last lines
        failure += "".join(f"\n--- {' '.join(p.args)[-160:]}:\n{out[-1500:]}" for p, out in zip(procs, outputs))
    if failure:
        raise AssertionError(failure)
    return [(out, proc.returncode, seconds) for out, proc, seconds in zip(outputs, procs, ended)]


def _results(out_dir: Path, n_scenarios: int, world: int) -> list[list[dict[str, Any]]]:
    return [
        [torch.load(out_dir / f"{i}_rank{r}.pt", map_location="cpu") for r in range(world)] for i in range(n_scenarios)
    ]


def _spec(out_dir: Path, scenarios: list[dict[str, Any]], worker: Path = WORKERS / "ds_worker.py") -> list[str]:
    spec = out_dir / "scenarios.json"
    spec.write_text(json.dumps(scenarios))
    return [str(worker), "--spec", str(spec), "--out", str(out_dir)]


def rank_launch(world: int, script: list[str], launcher: str = "deepspeed") -> tuple[list[list[str]], list[dict]]:
    """The commands and environments with which a launcher on one node starts ``world`` ranks of ``script``
    (a path and its arguments): ``deepspeed`` (``deepspeed.launcher.launch``: ``RANK``, ``LOCAL_RANK``,
    ``WORLD_SIZE``, ``LOCAL_SIZE``, ``CROSS_RANK``/``CROSS_SIZE``, ``MASTER_*``, and a ``--local_rank=R`` argument)
    or ``torchrun`` (the same without the argument, with ``LOCAL_WORLD_SIZE``). They meet at a store this process
    serves on a :func:`held_port` (``TORCHELASTIC_USE_AGENT_STORE``), until :func:`run` returns."""
    port = str(held_port())
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(world)}
    common |= {"TORCHELASTIC_USE_AGENT_STORE": "True"}
    common |= {"LOCAL_SIZE": str(world), "CROSS_RANK": "0", "CROSS_SIZE": "1"} if launcher == "deepspeed" else {}
    common |= {"LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0"} if launcher == "torchrun" else {}
    cmds, envs = [], []
    for rank in range(world):
        argument = [f"--local_rank={rank}"] if launcher == "deepspeed" else []
        cmds.append([sys.executable, "-u", script[0], *argument, *script[1:]])
        envs.append({**common, "RANK": str(rank), "LOCAL_RANK": str(rank)})
    return cmds, envs


def deepspeed_run(
    world: int,
    out_dir: Path,
    scenarios: list[dict[str, Any]],
    timeout: float = 240,
    worker: Path = WORKERS / "ds_worker.py",
    left_segments: Optional[list[Path]] = None,
) -> list[list[dict[str, Any]]]:
    """Run ``worker`` (``--spec``, ``--out``; by default ``workers/ds_worker.py``) on ``world`` ranks started as
    ``deepspeed --num_gpus world`` starts them (:func:`rank_launch`); return each scenario's per-rank results
    (``<out>/<scenario>_rank<r>.pt``; ``left_segments``: see :func:`run`)."""
    cmds, envs = rank_launch(world, _spec(out_dir, scenarios, worker))
    run(cmds, timeout, left_segments=left_segments, rank_envs=envs, preload=True)
    return _results(out_dir, len(scenarios), world)


def deepspeed_script(world: int, script: list[str], timeout: float, log: Path) -> None:
    """Run ``script`` (a path and its arguments) on ``world`` preloaded ranks started as ``deepspeed --num_gpus
    world`` starts them (:func:`rank_launch`), their output written to ``log``: the benchmarks' runs in the tests
    (the benchmarks' own ``launch`` runs the real launcher)."""
    cmds, envs = rank_launch(world, script)
    log.write_text("".join(run(cmds, timeout, rank_envs=envs, preload=True)))


def benchmark_launch(
    task: Any, config: Path, seed: int, out: Path, run_name: str, extra: Sequence[str], timeout: float
) -> None:
    """``benchmarks/time_to_target.py``'s ``launch`` (which ``batch_scaling`` calls too) on 2 preloaded ranks
    (:func:`deepspeed_script`): the run's script and arguments (its ``script_args``), its log. The benchmark's own
    ``launch`` runs the real launcher, tested on its own in test_time_to_target.py. The calling test has imported
    the benchmark."""
    from time_to_target import script_args

    deepspeed_script(2, script_args(task, config, seed, out, run_name, extra), timeout, out / f"{run_name}.log")


def torchrun_two_nodes(
    out_dir: Path, scenarios: list[dict[str, Any]], timeout: float = 240
) -> list[list[dict[str, Any]]]:
    """A two-node job on loopback: two ``torchrun`` invocations, node ranks 0 and 1, one process each."""
    port = str(free_port())
    worker = _spec(out_dir, scenarios)
    cmds = [
        [
            str(BIN / "torchrun"),
            "--nnodes",
            "2",
            "--node_rank",
            str(node),
            "--nproc_per_node",
            "1",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            port,
        ]
        + worker
        for node in (0, 1)
    ]
    run(cmds, timeout)
    return _results(out_dir, len(scenarios), 2)


def deepspeed_nodes(
    nodes: int, per_node: int, out_dir: Path, scenarios: list[dict[str, Any]], timeout: float = 240
) -> list[list[dict[str, Any]]]:
    """A job of ``nodes`` nodes x ``per_node`` ranks through the ``deepspeed`` launcher's multi-node path, on this
    machine: a hostfile naming ``nodes`` hosts, and one ``deepspeed --hostfile --no_ssh --node_rank R`` per node
    (as each node of a cluster without ssh runs it), all meeting at ``127.0.0.1``."""
    hostfile = out_dir / "hostfile"
    hostfile.write_text("".join(f"node{n} slots={per_node}\n" for n in range(nodes)))
    port = str(free_port())
    worker = _spec(out_dir, scenarios)
    cmds = [
        [str(BIN / "deepspeed"), "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(node)]
        + ["--master_addr", "127.0.0.1", "--master_port", port]
        + worker
        for node in range(nodes)
    ]
    run(cmds, timeout)
    return _results(out_dir, len(scenarios), nodes * per_node)


def torchrun(
    world: int, out_dir: Path, scenarios: list[dict[str, Any]], timeout: float = 300
) -> list[list[dict[str, Any]]]:
    """Run ``workers/ddp_worker.py`` (standalone K-FAC under DDP) on ``world`` ranks started as ``torchrun
    --nproc_per_node world`` starts them (:func:`rank_launch`)."""
    cmds, envs = rank_launch(world, _spec(out_dir, scenarios, WORKERS / "ddp_worker.py"), "torchrun")
    run(cmds, timeout, rank_envs=envs, preload=True)
    return _results(out_dir, len(scenarios), world)
