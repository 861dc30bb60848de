"""Cells (cells.py, shells.py, output.py): values, output, errors and their tracebacks, interrupts,
the output limit."""

import time

import pytest

from agent_harness import MIB, needs, text


def test_state_persists_and_last_expression_is_the_result(agent):
    first, _ = agent.run("x = 20")
    assert first["result"] is None and first["error"] is None
    second, _ = agent.run("y = x + 1\nx * 2 + 2")
    assert second["result"]["text/plain"] == "42"
    assert second["execution_count"] == first["execution_count"] + 1
    none, _ = agent.run("None")
    assert none["result"] is None
    text_result, _ = agent.run("'a' * 3")
    assert text_result["result"]["text/plain"] == "'aaa'"


def test_result_is_not_printed_to_stdout(agent):
    result, events = agent.run("print('side'); 6 * 7")
    assert result["result"]["text/plain"] == "42"
    assert text(events, "stdout") == "side\n", f"the value must not also appear on stdout: {events}"


def test_print_and_child_process_output_are_captured(agent):
    _, events = agent.run(
        "import os, subprocess, sys\n"
        "print('from print')\n"
        "os.system('echo hi')\n"
        "subprocess.run(['sh', '-c', 'echo child-err >&2'])\n"
        "print('to stderr', file=sys.stderr)\n"
    )
    stdout, stderr = text(events, "stdout"), text(events, "stderr")
    assert "from print\n" in stdout and "hi\n" in stdout, stdout
    assert "child-err\n" in stderr and "to stderr\n" in stderr, stderr


def test_error_is_reported_with_plain_traceback(agent):
    result, events = agent.run("a = 1\n1/0")
    assert result["result"] is None
    error = result["error"]
    assert error["name"] == "ZeroDivisionError"
    assert error["value"] == "division by zero"
    joined = "\n".join(error["traceback"])
    assert "1/0" in joined and "ZeroDivisionError" in joined, joined
    assert "\x1b" not in joined, "traceback must have no ANSI colour codes"
    assert "ZeroDivisionError" not in text(events, "stdout"), "traceback must not be printed too"
    after, _ = agent.run("a")
    assert after["result"]["text/plain"] == "1"


def test_syntax_error(agent):
    result, _ = agent.run("def broken(:\n    pass")
    assert result["error"]["name"] == "SyntaxError", result


@pytest.mark.parametrize(
    "code", ["while True: pass", "import time\ntime.sleep(100)"], ids=["busy-loop", "sleep"]
)
def test_interrupt_stops_the_cell_and_keeps_state(agent, code):
    agent.run("survivor = 42")
    cell = agent.start("exec", code=code)
    agent.wait_busy()
    started = time.monotonic()
    _, answer = agent.ok("interrupt", target=cell)
    assert answer == {"interrupted": True}
    _, final = agent.wait(cell, timeout=10)
    assert time.monotonic() - started < 5, "interrupt took too long"
    assert final["ok"] and final["result"]["error"]["name"] == "KeyboardInterrupt", final
    shown = "\n".join(final["result"]["error"]["traceback"])
    assert "on_sigint" not in shown and "sandgate_agent" not in shown, "agent frame shown"
    after, _ = agent.run("survivor")
    assert after["result"]["text/plain"] == "42"


def test_repeated_interrupts_all_land(agent):
    # Interrupting right after the cell starts probes the window before time.sleep's system call.
    for _ in range(5):
        cell = agent.start("exec", code="import time\ntime.sleep(100)")
        agent.wait_busy()
        assert agent.ok("interrupt", target=cell)[1] == {"interrupted": True}
        _, final = agent.wait(cell, timeout=10)
        assert final["result"]["error"]["name"] == "KeyboardInterrupt"


def test_output_is_truncated_with_marker(agent):
    started = time.monotonic()
    result, events = agent.run("print('x' * 200_000_000)\nprint('more')", timeout=60)
    assert time.monotonic() - started < 30
    assert result["truncated"] is True
    stdout = text(events, "stdout")
    assert len(stdout.encode()) <= MIB
    assert stdout.startswith("xxxx")
    marker = f"\n[output truncated: limit of {MIB} bytes reached]\n"
    assert text(events, "stderr") == marker
    small, events = agent.run("print('y' * 100)", output_limit=10)
    assert small["truncated"] and text(events, "stdout") == "y" * 10
    fine, _ = agent.run("print('ok')")
    assert fine["truncated"] is False


def test_a_traceback_through_the_agent_shows_only_the_user_s_frames(agent):
    # plt.show is the agent's (display.py): an error raised under it, in user code, passes through
    # frames of the agent's files, which the user must not see (nor any other agent file).
    needs(agent, "matplotlib")
    # Once pyplot is imported (here, or by the background import), the next cell has the agent's
    # plt.show.
    agent.run("import matplotlib.pyplot")
    code = (
        "import matplotlib.pyplot as plt\n"
        "fig = plt.figure()\n"
        "def user_savefig(*args, **kwargs):\n"
        "    raise ValueError('from user code')\n"
        "fig.savefig = user_savefig\n"
        "plt.show()"
    )
    result, _ = agent.run(code)
    error = result["error"]
    assert error is not None and error["name"] == "ValueError", result
    shown = "\n".join(error["traceback"])
    assert "user_savefig" in shown and "plt.show()" in shown, shown
    assert "sandgate_agent" not in shown and "_emit" not in shown, f"agent frame shown: {shown}"
