"""The suite's launcher (tests/launch.py): what it reports of each launch (the ledger behind the suite's summary of
where its time goes, issue 48) and how it fails."""

from __future__ import annotations

import os
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
    with pytest.raises(AssertionError, match=r"timed out after 2s"):
        launch.run([_python("import time; time.sleep(60)")], timeout=2)
    assert time.monotonic() - started < 10
