"""Commands (commands.py): output, exit codes, timeouts, interrupts, the output limit."""

import time
import uuid

from agent_harness import pids_with_mark, text, wait_until


def test_command_output_and_exit_code(agent):
    events, result = agent.ok(
        "command", command="echo out; echo err >&2; exit 3", timeout_ms=10_000
    )
    assert text(events, "stdout") == "out\n"
    assert text(events, "stderr") == "err\n"
    assert result == {"exit_code": 3, "signal": None, "timed_out": False, "truncated": False}
    events, _ = agent.ok("command", command="pwd", timeout_ms=10_000)
    assert text(events, "stdout").strip() == str(agent.home)
    (agent.home / "sub").mkdir()
    events, _ = agent.ok("command", command="pwd", cwd="sub", timeout_ms=10_000)
    assert text(events, "stdout").strip() == str(agent.home / "sub")


def test_command_timeout_kills_the_whole_group(agent):
    mark = uuid.uuid4().hex
    started = time.monotonic()
    _, result = agent.ok(
        "command",
        command=f"export SANDGATE_TEST_MARK={mark}; sleep 1000 & sleep 1000",
        timeout_ms=1000,
    )
    assert time.monotonic() - started < 5, "timeout must return promptly"
    assert result["timed_out"] is True
    assert result["signal"] == 9 and result["exit_code"] is None
    wait_until(lambda: not pids_with_mark(mark), 5, "a `sleep 1000` survived the timeout")


def test_command_returns_when_main_process_exits(agent):
    mark = uuid.uuid4().hex
    started = time.monotonic()
    events, result = agent.ok(
        "command",
        command=f"export SANDGATE_TEST_MARK={mark}; echo bg; sleep 100 &",
        timeout_ms=60_000,
    )
    assert time.monotonic() - started < 5, "must not wait for pipes held by background children"
    assert result["exit_code"] == 0 and result["timed_out"] is False
    assert text(events, "stdout") == "bg\n"
    wait_until(lambda: not pids_with_mark(mark), 5, "the background sleep survived")


def test_interrupt_kills_command(agent):
    cmd = agent.start("command", command="sleep 1000", timeout_ms=100_000)
    wait_until(lambda: agent.ok("interrupt", target=cmd)[1]["interrupted"], 10, "never interrupted")
    _, final = agent.wait(cmd, timeout=10)
    assert final["result"]["signal"] == 9


def test_command_output_is_capped(agent):
    events, result = agent.ok(
        "command",
        command="head -c 5000000 /dev/zero | tr '\\0' a",
        timeout_ms=30_000,
        output_limit=1000,
    )
    assert result["truncated"] is True and result["exit_code"] == 0
    assert text(events, "stdout") == "a" * 1000
    assert "[output truncated: limit of 1000 bytes reached]" in text(events, "stderr")
