"""tests/launch_helpers.py: a failed run or fixture build says what failed; a SIGKILL stops the whole session."""

import subprocess
import sys
import time

import pytest

from tests.launch_helpers import cli, failing_fixture, finish, sigkill_when


def python(code):
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_cli_writes_flags_in_order():
    assert cli(max_steps=3, use_peft="true", output_dir="/tmp/x") == [
        "--max_steps", "3", "--use_peft", "true", "--output_dir", "/tmp/x"]


def test_finish_returns_the_output_or_fails_with_its_errors():
    assert finish(python("print('fine')")) == "fine\n"
    with pytest.raises(AssertionError, match=r"(?s)the tiny run exited with 3:\nValueError: bad flag.*last output"):
        finish(python("print('ValueError: bad flag'); import sys; sys.exit(3)"), what="the tiny run")


def test_failing_fixture_names_the_fixture_and_keeps_the_cause():
    with pytest.raises(RuntimeError, match="building the tiny VLM failed: OSError: disk full") as info:
        with failing_fixture("the tiny VLM"):
            raise OSError("disk full")
    assert isinstance(info.value.__cause__, OSError)
    with failing_fixture("nothing"):
        pass


def test_sigkill_when_kills_the_session_once_ready_and_fails_if_the_run_ended_first(tmp_path):
    marker, child_pid = tmp_path / "ready", tmp_path / "child"
    # a launcher and a worker of its own, as `accelerate launch` starts: both must die
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
            f"open({str(child_pid)!r}, 'w').write(str(p.pid)); open({str(marker)!r}, 'w').close(); time.sleep(60)")
    proc = python(code)
    sigkill_when(proc, marker, timeout=60)
    pid = int(child_pid.read_text())
    deadline = time.time() + 10
    while alive(pid):  # killed with the launcher (its zombie, if no one has reaped it yet, counts as dead)
        assert time.time() < deadline, f"the worker {pid} outlived its launcher"
        time.sleep(0.05)
    with pytest.raises(AssertionError, match="the run ended"):
        sigkill_when(python("print('done early')"), lambda: False, timeout=60)
