"""The suite's launcher (tests/launch.py): what it reports of each launch (the ledger behind the suite's summary of
where its time goes, issue 48) and how it fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import launch
import pytest

pytestmark = pytest.mark.timeout(60)


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_the_ledger_times_each_launch_and_each_process_first_output() -> None:
    """Two processes: one prints at once, the other after 0.6 s; the entry names this test and has both times."""
    before = len(launch.LEDGER)
    started = time.monotonic()
    out = launch.run([_python("print('a')"), _python("import time; time.sleep(0.6); print('b'); print('c')")], 30)
    wall = time.monotonic() - started
    assert out == ["a\n", "b\nc\n"]
    (entry,) = launch.LEDGER[before:]
    assert entry.test == os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0]
    assert entry.test.endswith("test_the_ledger_times_each_launch_and_each_process_first_output")
    assert entry.processes == 2
    quick, slow = entry.first_output
    assert quick < 0.6 <= slow <= entry.seconds <= wall and entry.startup == slow


def test_a_failing_process_is_named_with_its_output_and_still_recorded() -> None:
    before = len(launch.LEDGER)
    with pytest.raises(AssertionError, match=r"(?s)exit 3: .*-c.*\nlast words\n"):
        launch.run([_python("print('last words'); raise SystemExit(3)"), _python("import time; time.sleep(30)")], 30)
    (entry,) = launch.LEDGER[before:]
    assert entry.processes == 2 and entry.seconds < 20  # the sleeper was killed, not waited for
    assert entry.first_output[1] is None and entry.startup is None  # it printed nothing


def test_a_child_holding_the_output_past_its_parent_fails_the_launch() -> None:
    """A process that exits 0 but leaves a child writing to the launch's pipe is a leak: named, and its group
    killed, within the launch's timeout."""
    code = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])"
    started = time.monotonic()
    with pytest.raises(AssertionError, match="a child outlived the process and held its output"):
        launch.run([_python(code)], timeout=3)
    assert time.monotonic() - started < 15


def test_a_launch_past_its_timeout_is_killed_and_named() -> None:
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"(?s)timed out after 2s: .*\nwaiting\n"):  # where it was
        launch.run([_python("print('waiting'); import time; time.sleep(60)")], timeout=2)
    assert time.monotonic() - started < 10


PROBE = """
import atexit, concurrent.futures, json, os, sys, threading, time
preloaded = "torch" in sys.modules  # before this script imports anything: the server's imports
import torch
atexit.register(lambda: print("atexit ran"))
torch.probe_pool = concurrent.futures.ThreadPoolExecutor(1)  # a library's pool, never shut down: the interpreter
torch.probe_pool.submit(time.sleep, 0.1)  # stops it (torch.compile's compile pool is one)
threading.Thread(target=lambda: (time.sleep(0.3), print("thread done"))).start()
print(json.dumps({
    "argv": sys.argv, "path": sys.path, "cwd": os.getcwd(), "probe": os.environ.get("PROBE"),
    "threads": torch.get_num_threads(), "name": __name__, "preloaded": preloaded,
}))
how = sys.argv[1]
if how == "raise":
    raise ValueError("boom")
if how == "message":
    raise SystemExit("a message")
if how == "code":
    sys.exit(3)
"""


@pytest.mark.parametrize("how", ["return", "raise", "message", "code"])
def test_a_preloaded_rank_runs_its_script_as_a_fresh_interpreter_does(
    tmp_path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The same script, started fresh and forked from the preloaded server (``preload=True``), in the same directory
    and environment: the same arguments, ``sys.path`` (a relative ``PYTHONPATH`` entry taken from that directory),
    directory, variables, thread count and ``__main__``, the same end (an executor left running stopped and a thread
    joined, then ``atexit``; the traceback or message, and exit code, of each way out); only the forked one finds
    torch already imported."""
    script = tmp_path / "sub" / "probe.py"
    script.parent.mkdir()
    script.write_text(PROBE)
    monkeypatch.chdir(tmp_path)
    cmd = [sys.executable, "-u", str(script), how]
    ends = {}
    for preload in (False, True):
        try:
            env = {"PROBE": "yes", "PYTHONPATH": "lib"}  # relative: taken from the directory it starts in
            (out,) = launch.run([cmd], timeout=60, env=env, preload=preload)
            ends[preload] = ("exit 0", out)
        except AssertionError as err:
            ends[preload] = tuple(str(err).split("\n", 1))
    (fresh_end, fresh), (forked_end, forked) = ends[False], ends[True]
    assert forked_end.split(":", 1)[0] == fresh_end.split(":", 1)[0]  # "exit N"
    assert fresh_end.split(":", 1)[0] == {"return": "exit 0", "raise": "exit 1", "message": "exit 1"}.get(how, "exit 3")
    probe = {False: json.loads(fresh.splitlines()[0]), True: json.loads(forked.splitlines()[0])}
    assert not probe[False].pop("preloaded") and probe[True].pop("preloaded")
    assert probe[True] == probe[False]
    assert probe[True]["argv"] == [str(script), how] and probe[True]["path"][:2] == [
        str(script.parent),
        str(tmp_path / "lib"),
    ]
    assert probe[True]["cwd"] == str(tmp_path) and probe[True]["probe"] == "yes" and probe[True]["threads"] == 1
    assert probe[True]["name"] == "__main__"
    for out in (fresh, forked):
        rest = out.splitlines()[1:]
        assert rest[-2:] == ["thread done", "atexit ran"]  # the thread is joined before the atexit handlers
        assert ("ValueError: boom" in rest) == (how == "raise") and ("a message" in rest) == (how == "message")


def test_a_preloaded_launch_past_its_timeout_is_killed_and_named(tmp_path) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(60)\n")
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"timed out after 2s"):
        launch.run([[sys.executable, "-u", str(script)]] * 2, timeout=2, preload=True)
    assert time.monotonic() - started < 10


def test_only_a_python_script_can_be_preloaded() -> None:
    with pytest.raises(ValueError, match=r"a preloaded rank runs `.*python.* -u SCRIPT \.\.\.`, not \['deepspeed'"):
        launch.run([[sys.executable, "-u", "ok.py"], ["deepspeed", "x.py"]], timeout=10, preload=True)


def test_leftovers_names_a_live_child_and_a_live_forked_rank_but_not_the_servers(tmp_path) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text("import time\ntime.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    rank = launch.Forked([sys.executable, "-u", str(script)], dict(os.environ))
    try:
        assert {child.pid, rank.pid} <= set(launch.leftovers())
    finally:
        for proc in (child, rank):
            os.kill(proc.pid, 9)
            proc.wait()
        rank.stdout.close()
    assert not launch.leftovers()  # the fork server and resource tracker stay, and are not counted
