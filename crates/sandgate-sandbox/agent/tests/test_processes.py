"""Processes (processes.py): sweeps end what a call leaves behind, and spare what a running call
started."""

import os
import time

from agent_harness import alive, gone_within, wait_until


def test_escapes_from_a_timed_out_command_do_not_survive(agent):
    marker = f"{os.getpid()}{time.monotonic_ns() % 100000}"
    command = (
        f"setsid sleep 7{marker} & nohup sleep 8{marker} >/dev/null 2>&1 & "
        f"(sleep 9{marker} &) ; sleep 60"
    )
    _, final = agent.ok("command", command=command, timeout_ms=500)
    assert final["timed_out"] is True
    for prefix in "789":
        assert gone_within(f"sleep {prefix}{marker}"), f"sleep {prefix}{marker} survived"


def test_escapes_from_an_interrupted_cell_do_not_survive(agent):
    marker = f"{os.getpid()}{time.monotonic_ns() % 100000}"
    cell = agent.start(
        "exec",
        code=(
            "import subprocess, time\n"
            f"subprocess.Popen(['setsid', 'sleep', '6{marker}'])\n"
            f"subprocess.Popen(['sh', '-c', '(sleep 5{marker} &)'])\n"
            "time.sleep(100)"
        ),
    )
    agent.wait_busy()
    deadline = time.monotonic() + 10
    while not (alive(f"sleep 6{marker}") and alive(f"sleep 5{marker}")):
        assert time.monotonic() < deadline, "the cell's children never started"
        time.sleep(0.05)
    agent.ok("interrupt", target=cell)
    _, final = agent.wait(cell)
    assert final["result"]["error"]["name"] == "KeyboardInterrupt"
    for prefix in "65":
        assert gone_within(f"sleep {prefix}{marker}"), f"sleep {prefix}{marker} survived"
    assert agent.run("1 + 1")[0]["result"]["text/plain"] == "2"


def test_what_a_running_cell_started_survives_other_calls_until_the_cell_is_interrupted(agent):
    marker = f"{os.getpid()}{time.monotonic_ns() % 100000}"
    started = agent.home / f"started-{marker}"
    cell = agent.start(
        "exec",
        code=(
            "import subprocess, time\n"
            f"subprocess.Popen(['setsid', 'sleep', '6{marker}'])\n"
            # The shell has exited when wait() returns: its background sleep is an orphan.
            f"subprocess.Popen(['sh', '-c', '(sleep 5{marker} &)']).wait()\n"
            f"subprocess.Popen(['nohup', 'sleep', '4{marker}'], stdout=subprocess.DEVNULL,"
            " stderr=subprocess.DEVNULL)\n"
            f"open({str(started)!r}, 'w').close()\n"
            "time.sleep(100)"
        ),
    )
    wait_until(started.exists, 30, "the cell never started its children")
    # Other calls end, and sweep, while the cell runs (commands: a cell would wait behind it).
    agent.ok("command", command="true", timeout_ms=5000)
    agent.ok("command", command="true", timeout_ms=5000)
    for prefix in "654":
        assert alive(f"sleep {prefix}{marker}"), (
            f"sleep {prefix}{marker} of the running cell was killed by another call's sweep"
        )
    agent.ok("interrupt", target=cell)
    _, final = agent.wait(cell)
    assert final["result"]["error"]["name"] == "KeyboardInterrupt"
    for prefix in "654":
        assert gone_within(f"sleep {prefix}{marker}"), f"sleep {prefix}{marker} survived"


def test_what_a_running_command_started_survives_other_calls_until_the_command_ends(agent):
    marker = f"{os.getpid()}{time.monotonic_ns() % 100000}"
    started = agent.home / f"started-{marker}"
    command = agent.start(
        "command",
        command=f"(sleep 3{marker} &); nohup sleep 2{marker} >/dev/null 2>&1 & "
        f"touch {started}; sleep 100",
        timeout_ms=60000,
    )
    wait_until(started.exists, 30, "the command never started its children")
    agent.run("1 + 1")  # a cell's end sweeps
    agent.ok("command", command="true", timeout_ms=5000)  # so does another command's
    for prefix in "32":
        assert alive(f"sleep {prefix}{marker}"), (
            f"sleep {prefix}{marker} of the running command was killed by another call's sweep"
        )
    agent.ok("interrupt", target=command)
    agent.wait(command)
    for prefix in "32":
        assert gone_within(f"sleep {prefix}{marker}"), f"sleep {prefix}{marker} survived"
