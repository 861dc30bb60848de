"""The agent's side of the kernel (kernels.py): the exec queue, restarts, a kernel that dies, frames
the kernel forges."""

import base64
import json
import os
import queue
import signal
import sys
import time
import types

from agent_harness import AGENT_DIR, alive


def test_interrupt_of_queued_exec_removes_it(agent):
    running = agent.start("exec", code="import time\ntime.sleep(1.5)")
    queued = agent.start("exec", code="never = 1")
    _, answer = agent.ok("interrupt", target=queued)
    assert answer == {"interrupted": True}
    _, final = agent.wait(queued)
    assert final["result"]["error"]["name"] == "KeyboardInterrupt"
    _, done = agent.wait(running)
    assert done["result"]["error"] is None
    check, _ = agent.run("'never' in globals()")
    assert check["result"]["text/plain"] == "False"


def test_interrupt_of_unknown_target_is_false(agent):
    assert agent.ok("interrupt", target=999)[1] == {"interrupted": False}


def test_restart_loses_state_but_keeps_files(agent):
    agent.run("lost = 1\nopen('kept.txt', 'w').write('still here')")
    old_kernel = agent.ready["kernel_pid"]
    _, answer = agent.ok("restart", timeout=60)
    assert answer["restarted"] is True and answer["kernel_pid"] != old_kernel, answer
    assert agent.ok("ping")[1]["pid"] == agent.proc.pid, "the agent itself lives on"
    result, _ = agent.run("'lost' in globals()")
    assert result["result"]["text/plain"] == "False"
    assert result["state_lost"] is False, "the gateway asked for it and already knows"
    events, _ = agent.ok("read_file", path="kept.txt", max_bytes=100)
    assert base64.b64decode(events[0]["data"]) == b"still here"


def test_a_cell_that_kills_its_own_kernel_reports_state_lost_and_the_next_cell_runs(agent):
    agent.run("doomed = 1\nopen('kept.txt', 'w').write('still here')")
    result, _ = agent.run("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", timeout=60)
    assert result["state_lost"] is True, result
    assert "SIGKILL" in result["state_lost_reason"], result
    assert result["error"]["name"] == "KernelDied", result
    after, _ = agent.run("print(open('kept.txt').read())\n'doomed' in globals()", timeout=60)
    assert after["result"]["text/plain"] == "False", after
    assert after["state_lost"] is False, "reported once, with the cell that died"


def test_a_kernel_killed_between_cells_is_reported_by_the_next_cell(agent):
    agent.run("x = 1")
    kernel = agent.ok("ping")[1]["kernel_pid"]
    os.kill(kernel, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while kernel in alive(""):  # as a terminal command's `kill -9` would have: it has landed
        assert time.monotonic() < deadline
        time.sleep(0.01)
    result, _ = agent.run("'x' in globals()", timeout=60)
    assert result["state_lost"] is True and "SIGKILL" in result["state_lost_reason"], result
    assert (result["result"] or {}).get("text/plain") == "False", result
    assert agent.ok("ping")[1]["kernel_pid"] != kernel


def test_os_exit_in_a_cell_is_reported(agent):
    result, _ = agent.run("import os\nos._exit(3)", timeout=60)
    assert result["state_lost"] is True and "status 3" in result["state_lost_reason"], result
    assert agent.run("1 + 1", timeout=60)[0]["result"]["text/plain"] == "2"


def test_frames_a_cell_forges_for_other_requests_are_not_relayed(agent):
    ping = agent.start("ping")
    agent.wait(ping)
    forged = json.dumps({"id": 4242, "ok": True, "result": {"forged": True}})
    code = (
        "import os\n"
        "for fd in range(3, 64):\n"
        "    try:\n"
        f"        os.write(fd, b'{forged}\\n')\n"
        "    except OSError:\n"
        "        pass\n"
        "'done'"
    )
    result, _ = agent.run(code)
    assert result["result"]["text/plain"] == "'done'", result
    agent.ok("ping")
    assert agent.poll_final(4242) is None, "a forged frame reached the gateway"


def test_a_kernel_s_frames_and_exit_wait_until_the_agent_has_made_it_current():
    """A kernel that says ready (or dies) before the agent has recorded it as the current kernel
    must not be taken for a replaced one: its ready frame and its exit are handled only once the
    agent has decided (white-box: a stand-in kernel that says ready and exits at once)."""
    sys.path.insert(0, str(AGENT_DIR))
    try:
        from sandgate_agent import kernels
    finally:
        sys.path.remove(str(AGENT_DIR))
    rt = types.SimpleNamespace(
        creds=types.SimpleNamespace(popen_args=lambda: {}),
        archive_fd=None,
        kernel_argv=[
            sys.executable,
            "-c",
            "import os; fd = int(os.environ['SANDGATE_KERNEL_FDS'].split(',')[1]); "
            "os.write(fd, b'{\"event\": \"ready\"}\\n')",
        ],
    )
    seen = queue.Queue()
    fake_agent = types.SimpleNamespace(
        on_kernel_line=lambda kp, line: seen.put(("line", line)),
        on_kernel_junk=lambda kp, why: seen.put(("junk", why)),
        on_kernel_exit=lambda kp, code: seen.put(("exit", code)),
    )
    kp = kernels.KernelProcess(rt, fake_agent)
    kp.proc.wait(timeout=30)
    time.sleep(0.5)  # time enough for the reader and the waiter to act, were they free to
    assert seen.empty(), "nothing is handled before the agent has decided"
    kp.decided.set()
    got = {seen.get(timeout=10), seen.get(timeout=10)}
    assert got == {("line", b'{"event": "ready"}'), ("exit", 0)}, got
    kp.kill()


def test_preloaded_waits_for_the_data_stack_without_running_a_cell(agent):
    """`preloaded` (a template is checkpointed after it): answered once the background import has
    ended, with the modules it loaded, and no cell run: the first cell after it is still number 1
    and finds the data stack imported without importing it itself."""
    _, answer = agent.ok("preloaded", timeout=120, timeout_ms=110_000)
    assert answer["done"] is True, answer
    assert answer["kernel_pid"] == agent.ready["kernel_pid"], answer
    assert answer["next_count"] == 1, answer
    assert answer["modules"] == agent.ready["preloaded"], (answer, agent.ready)
    result, _ = agent.run("import sys\nsorted(m for m in ('numpy', 'pandas', 'matplotlib') if m in sys.modules)")
    assert result["execution_count"] == 1, result
    assert result["result"]["text/plain"] == repr(sorted(agent.ready["preloaded"])), result
    # Asked again, it answers at once the same way (the import is long done).
    _, again = agent.ok("preloaded", timeout_ms=1000)
    assert again["done"] is True and again["modules"] == answer["modules"], again


def test_preloaded_refuses_a_bad_timeout(agent):
    _, final = agent.call("preloaded", timeout_ms=-1)
    assert not final["ok"] and final["error"]["kind"] == "bad_request", final
    assert agent.ok("ping")[1]["pong"] is True
