"""Behavioural tests of the sandbox agent (agent.py) against its protocol (PROTOCOL.md).

Each test starts the agent as a subprocess with a temporary home (SANDGATE_AGENT_HOME) and talks
to it over stdin/stdout exactly as the gateway does. Every test runs under several kernels:

* ``ipython``: the interpreter running pytest, which must have IPython, numpy, pandas, matplotlib;
* ``plain``: the same interpreter with IPython made unimportable, so the plain-``exec`` fallback is
  exercised with the data stack present;
* ``bare``: /usr/bin/python3 when it lacks IPython (Debian's python3 without packages), if present.

Run:  python3 -m venv /tmp/agent-venv
      /tmp/agent-venv/bin/pip install pytest ipython numpy pandas matplotlib
      /tmp/agent-venv/bin/python -m pytest -q crates/sandgate-sandbox/agent/test_agent.py

AGENT_TEST_PYTHONS (colon-separated interpreter paths) replaces the list of interpreters; each is
then run as it is (kernel named after whether it can import IPython).
"""

import base64
import hashlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
import zlib
from pathlib import Path

import pytest

AGENT = Path(__file__).resolve().with_name("agent.py")
BOOTSTRAP = AGENT.with_name("bootstrap.py")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MIB = 1 << 20


def _has_ipython(python, env=None):
    probe = subprocess.run([python, "-c", "import IPython"], env=env, capture_output=True)
    return probe.returncode == 0


def _kernels():
    """(id, python, hide_ipython) for every kernel variant available on this machine."""
    explicit = os.environ.get("AGENT_TEST_PYTHONS")
    if explicit:
        out = []
        for python in explicit.split(os.pathsep):
            name = "ipython" if _has_ipython(python) else "plain"
            out.append((f"{name}:{python}", python, False))
        return out
    out = [("ipython", sys.executable, False), ("plain", sys.executable, True)]
    system = "/usr/bin/python3"
    if (
        os.path.exists(system)
        and os.path.realpath(system) != os.path.realpath(sys.executable)
        and not _has_ipython(system)
    ):
        out.append(("bare", system, False))
    return out


KERNELS = _kernels()


class AgentProcess:
    """A running agent and a minimal client of its protocol."""

    def __init__(self, python, home, hide_ipython, workdir, via_c=False, bootstrap=True):
        env = dict(os.environ)
        env["SANDGATE_AGENT_HOME"] = str(home)
        env["HOME"] = str(home)
        # One matplotlib cache for the whole session: building its font cache takes seconds.
        env["MPLCONFIGDIR"] = str(workdir / "mplconfig")
        env.pop("PYTHONPATH", None)
        # Each agent's package index relay on a port of its own (tests run agents side by side).
        env["SANDGATE_AGENT_INDEX_PORT"] = "0"
        if hide_ipython:
            stub = workdir / "no-ipython"
            (stub / "IPython").mkdir(parents=True, exist_ok=True)
            (stub / "IPython" / "__init__.py").write_text(
                "raise ImportError('IPython hidden by test_agent.py')\n"
            )
            env["PYTHONPATH"] = str(stub)
        self.stderr_path = home.parent / f"agent-stderr-{uuid.uuid4().hex[:8]}.log"
        if not via_c:
            argv = [python, "-u", str(AGENT)]
        elif bootstrap:
            # The gateway starts the agent as `python3 -u -c <bootstrap.py> <agent.py>`, agent.py
            # compressed as sandgate-sandbox's docker.rs does (zlib, then base64).
            packed = base64.b64encode(zlib.compress(AGENT.read_bytes(), 9)).decode()
            argv = [python, "-u", "-c", BOOTSTRAP.read_text(), packed]
        else:
            argv = [python, "-u", "-c", AGENT.read_text()]
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.stderr_path, "wb"),
            env=env,
            cwd=str(home.parent),
        )
        self.home = Path(os.path.realpath(home))
        self.next_id = 1
        self.send_lock = threading.Lock()
        self.queues_lock = threading.Lock()
        self.queues = {}
        self.readies = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = self.wait_ready()

    def _queue(self, req_id):
        with self.queues_lock:
            return self.queues.setdefault(req_id, queue.Queue())

    def _read(self):
        for line in self.proc.stdout:
            frame = json.loads(line)  # anything but JSON on the stream is a protocol violation
            if frame.get("event") == "ready":
                self.readies.put(frame)
            else:
                self._queue(frame.get("id")).put(frame)
        self.readies.put(None)

    def wait_ready(self, timeout=60):
        try:
            frame = self.readies.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"no ready frame within {timeout}s; stderr: {self.stderr()}")
        assert frame is not None, f"agent exited before ready; stderr: {self.stderr()}"
        return frame

    def stderr(self):
        return self.stderr_path.read_text(errors="replace")[-4000:]

    def send_raw(self, data):
        with self.send_lock:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()

    def send(self, frame):
        self.send_raw((json.dumps(frame) + "\n").encode())

    def start(self, op, **args):
        req_id = self.next_id
        self.next_id += 1
        self.send({"id": req_id, "op": op, **args})
        return req_id

    def wait(self, req_id, timeout=30):
        """Returns (events, final frame) of a request."""
        q = self._queue(req_id)
        events = []
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                frame = q.get(timeout=max(0.0, left))
            except queue.Empty:
                pytest.fail(
                    f"request {req_id} not answered within {timeout}s; stderr: {self.stderr()}"
                )
            if "event" in frame:
                events.append(frame)
            else:
                return events, frame

    def poll_final(self, req_id):
        """The final frame of a request if it has arrived (events are kept), else None."""
        q = self._queue(req_id)
        seen = []
        final = None
        while True:
            try:
                frame = q.get_nowait()
            except queue.Empty:
                break
            if "event" in frame:
                seen.append(frame)
            else:
                final = frame
        for frame in seen + ([final] if final else []):
            q.put(frame)
        return final

    def call(self, op, timeout=30, **args):
        return self.wait(self.start(op, **args), timeout)

    def ok(self, op, timeout=30, **args):
        events, final = self.call(op, timeout, **args)
        assert final["ok"], f"{op} failed: {final}"
        return events, final["result"]

    def run(self, code, timeout=30, **args):
        """Runs a cell; returns (exec result, events)."""
        events, result = self.ok("exec", timeout, code=code, **args)
        return result, events

    def wait_busy(self, timeout=10):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ok("ping")[1]["busy"]:
                return
        pytest.fail("agent never became busy")

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def text(events, stream):
    return "".join(e["data"] for e in events if e["event"] == stream)


def pids_with_mark(mark):
    """Live processes whose environment contains `mark` (our own uid's are readable)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
            with open(f"/proc/{entry}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if mark.encode() in environ and state != b"Z":
            found.append(int(entry))
    return found


def wait_until(predicate, timeout, message):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    pytest.fail(message)


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("agent-work")


@pytest.fixture(params=KERNELS, ids=[k[0] for k in KERNELS])
def kernel(request):
    return request.param


@pytest.fixture
def agent(kernel, tmp_path, workdir):
    _, python, hide = kernel
    home = tmp_path / "home"
    home.mkdir()
    proc = AgentProcess(python, home, hide, workdir)
    yield proc
    proc.close()


def needs(agent, module):
    if module not in agent.ready["preloaded"]:
        pytest.skip(f"{module} not available in this interpreter")


# --------------------------------------------------------------------------------------------------
# Start-up


def test_ready_frame(agent, kernel):
    ready = agent.ready
    assert ready["protocol"] == 2
    assert ready["pid"] == agent.proc.pid
    assert ready["kernel_pid"] != agent.proc.pid, "cells run in a process of their own"
    assert isinstance(ready["python"], str) and ready["python"].startswith("3.")
    # Ready comes before the shell is built, so the frame can only say whether IPython is on the
    # path; whether cells really run in it shows in a cell.
    result, _ = agent.run("'get_ipython' in dir()")
    assert result["result"]["text/plain"] == str(kernel[0].startswith("ipython")), result


def test_a_cell_right_after_ready_gets_the_whole_data_stack_and_only_its_own_output(agent):
    # The data stack is still loading in the background when ready arrives: the cell's imports wait
    # for the modules it uses (complete, never half-initialised) and its output is its own.
    needs(agent, "pandas")
    needs(agent, "matplotlib")
    code = (
        "import pandas as pd\n"
        "import matplotlib.pyplot as plt\n"
        "print('own output')\n"
        "plt.plot([1, 2]); plt.show()\n"
        "int(pd.DataFrame({'a': [1, 2, 3]}).a.sum())"
    )
    result, events = agent.run(code)
    assert result["error"] is None, result
    assert result["result"]["text/plain"] == "6", result
    assert text(events, "stdout") == "own output\n", events
    assert text(events, "stderr") == "", events
    assert [e for e in events if e["event"] == "display"], "the chart comes back"


def test_a_plain_cell_right_after_ready_is_not_disturbed_by_the_preload(agent):
    result, events = agent.run("print('hi')\n1+1")
    assert result["error"] is None, result
    assert result["result"]["text/plain"] == "2", result
    assert text(events, "stdout") == "hi\n", events
    assert text(events, "stderr") == "", events


def test_user_code_cannot_read_protocol_input(agent):
    result, _ = agent.run("import sys\ndata = sys.stdin.read()\nlen(data)")
    assert result["error"] is None, result
    assert result["result"]["text/plain"] == "0"
    assert agent.ok("ping")[1]["pong"] is True


# --------------------------------------------------------------------------------------------------
# exec


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


def test_dataframe_has_html(agent):
    needs(agent, "pandas")
    result, _ = agent.run("import pandas as pd\npd.DataFrame({'a': [1, 2]})")
    bundle = result["result"]
    assert "<table" in bundle["text/html"], bundle
    assert "a" in bundle["text/plain"]


def test_ipython_display_call_becomes_display_event(agent, kernel):
    if not kernel[0].startswith("ipython"):
        pytest.skip("display() is an IPython feature")
    _, events = agent.run("from IPython.display import display, HTML\ndisplay(HTML('<b>x</b>'))")
    displays = [e for e in events if e["event"] == "display"]
    assert displays and displays[0]["data"]["text/html"] == "<b>x</b>", events


def test_plt_show_emits_png_and_saves_it(agent):
    needs(agent, "matplotlib")
    result, events = agent.run(
        "import matplotlib.pyplot as plt\nprint('before')\nplt.plot([1, 2, 3])\nplt.show()"
    )
    assert result["error"] is None, result
    kinds = [e["event"] for e in events]
    assert kinds.index("stdout") < kinds.index("display"), f"output order lost: {kinds}"
    displays = [e for e in events if e["event"] == "display"]
    assert len(displays) == 1, f"plt.show() must display the figure once: {events}"
    png = base64.b64decode(displays[0]["data"]["image/png"])
    assert png.startswith(PNG_SIGNATURE)
    path = Path(displays[0]["path"])
    assert path == agent.home / "outputs" / f"figure-{result['execution_count']}-1.png"
    assert path.read_bytes() == png
    # show() closed the figure: nothing is emitted again by the next cell.
    _, later = agent.run("len(plt.get_fignums())")
    assert not [e for e in later if e["event"] == "display"]


def test_figures_left_open_are_displayed_at_cell_end(agent):
    needs(agent, "matplotlib")
    result, events = agent.run(
        "import matplotlib.pyplot as plt\n"
        "fig1 = plt.figure(); plt.plot([1, 2])\n"
        "fig2 = plt.figure(); plt.plot([2, 1])\n"
    )
    displays = [e for e in events if e["event"] == "display"]
    assert len(displays) == 2, events
    count = result["execution_count"]
    assert [Path(d["path"]).name for d in displays] == [
        f"figure-{count}-1.png",
        f"figure-{count}-2.png",
    ]
    check, _ = agent.run("len(plt.get_fignums())")
    assert check["result"]["text/plain"] == "0"


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
    assert "on_sigint" not in "\n".join(final["result"]["error"]["traceback"]), "agent frame shown"
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


def test_control_ops_are_answered_while_a_cell_runs(agent):
    (agent.home / "data.txt").write_text("payload")
    cell = agent.start("exec", code="import time\ntime.sleep(3)")
    agent.wait_busy()
    events, read = agent.ok("read_file", path="data.txt", max_bytes=1000)
    assert base64.b64decode(events[0]["data"]) == b"payload"
    _, listing = agent.ok("list_dir", path=".")
    assert "data.txt" in [e["name"] for e in listing["entries"]]
    _, cmd = agent.ok("command", command="echo concurrent", timeout_ms=10_000)
    assert cmd["exit_code"] == 0
    assert agent.poll_final(cell) is None, "the cell should still be running"
    _, final = agent.wait(cell)
    assert final["ok"]
    assert agent.ok("ping")[1]["busy"] is False


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


def test_restart_when_started_with_dash_c(kernel, tmp_path, workdir):
    home = tmp_path / "home"
    home.mkdir()
    agent = AgentProcess(kernel[1], home, kernel[2], workdir, via_c=True)
    try:
        agent.run("lost = 1")
        assert agent.ok("restart", timeout=60)[1]["restarted"] is True
        result, _ = agent.run("'lost' in globals()")
        assert result["result"]["text/plain"] == "False"
    finally:
        agent.close()


def anonymous_kib(pid):
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1])
    raise AssertionError(f"no Anonymous line for pid {pid}")


def test_the_bootstrap_keeps_no_parse_tree_alive(kernel, tmp_path, workdir):
    # `python3 -c <agent.py>` keeps agent.py's parse tree for the process's whole life; the
    # bootstrap compiles it and lets it go. Same interpreter, same agent, measured side by side.
    sizes = {}
    for bootstrap in (False, True):
        home = tmp_path / f"home-{bootstrap}"
        home.mkdir()
        agent = AgentProcess(kernel[1], home, kernel[2], workdir, via_c=True, bootstrap=bootstrap)
        try:
            result, _ = agent.run("import sys; sys.argv")
            assert result["result"]["text/plain"] == "['-c', 'kernel']", result
            agent.ok("ping")
            sizes[bootstrap] = anonymous_kib(agent.ready["pid"])
        finally:
            agent.close()
    assert sizes[True] < sizes[False] - 1024, (
        f"the agent started through bootstrap.py should hold at least 1 MiB less anonymous memory "
        f"than one started as `-c <agent.py>` (KiB: {sizes})"
    )


def test_frames_after_restart_are_not_lost(agent):
    # Written in one go: the agent has read the ping before it restarts.
    agent.send_raw(b'{"id": 500, "op": "restart"}\n{"id": 501, "op": "ping"}\n')
    _, final = agent.wait(501)
    assert final["ok"] and final["result"]["pong"]
    _, restarted = agent.wait(500, timeout=60)
    assert restarted["ok"], restarted


def test_bad_frames_are_answered_and_ignored(agent):
    agent.send_raw(b"{not json\n")
    _, final = agent.wait(None)
    assert final == {
        "id": None,
        "ok": False,
        "error": {"kind": "bad_request", "message": final["error"]["message"]},
    }
    agent.send_raw(b"[1, 2]\n\xff\xfe\n")
    for _ in range(2):
        assert agent.wait(None)[1]["error"]["kind"] == "bad_request"
    agent.send({"id": 77, "op": "no_such_op"})
    assert agent.wait(77)[1]["error"]["kind"] == "bad_request"
    agent.send({"id": 78, "op": "exec"})
    assert agent.wait(78)[1]["error"]["kind"] == "bad_request"
    assert agent.ok("ping")[1]["pong"] is True
    result, _ = agent.run("1 + 1")
    assert result["result"]["text/plain"] == "2"


def test_agent_exits_on_stdin_eof(agent):
    mark = uuid.uuid4().hex
    agent.start(
        "command", command=f"export SANDGATE_TEST_MARK={mark}; sleep 1000", timeout_ms=100_000
    )
    wait_until(lambda: pids_with_mark(mark), 10, "command never started")
    agent.proc.stdin.close()
    agent.proc.wait(timeout=10)
    wait_until(lambda: not pids_with_mark(mark), 5, "command survived the agent")


# --------------------------------------------------------------------------------------------------
# command


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


# --------------------------------------------------------------------------------------------------
# files


def write_file(agent, path, data, overwrite=False, chunk=256 * 1024):
    req_id = agent.start("write_file", path=path, overwrite=overwrite, size=len(data))
    pieces = [data[i : i + chunk] for i in range(0, len(data), chunk)] or [b""]
    for i, piece in enumerate(pieces):
        agent.send(
            {
                "id": req_id,
                "op": "chunk",
                "data": base64.b64encode(piece).decode(),
                "last": i == len(pieces) - 1,
            }
        )
    return agent.wait(req_id)[1]


def test_chunked_write_and_read_of_10_mib(agent):
    data = os.urandom(10 * MIB)
    digest = hashlib.sha256(data).hexdigest()
    final = write_file(agent, "deep/dir/blob.bin", data)
    assert final["ok"], final
    target = agent.home / "deep" / "dir" / "blob.bin"
    assert final["result"] == {"path": str(target), "size": len(data), "sha256": digest}
    assert sorted(os.listdir(target.parent)) == ["blob.bin"], "temporary file left behind"
    events, result = agent.ok("read_file", path="deep/dir/blob.bin", max_bytes=20 * MIB)
    chunks = [base64.b64decode(e["data"]) for e in events if e["event"] == "chunk"]
    assert all(len(c) <= 256 * 1024 for c in chunks)
    assert b"".join(chunks) == data
    assert {k: result[k] for k in ("path", "size", "sha256")} == {
        "path": str(target),
        "size": len(data),
        "sha256": digest,
    }
    assert result["space"]["total"] > 0 and result["space"]["free"] >= 0, result


def test_write_exists_and_overwrite(agent):
    assert write_file(agent, "f.txt", b"one")["ok"]
    refused = write_file(agent, "f.txt", b"two")
    assert refused["error"]["kind"] == "exists"
    assert (agent.home / "f.txt").read_bytes() == b"one"
    assert write_file(agent, "f.txt", b"three", overwrite=True)["ok"]
    assert (agent.home / "f.txt").read_bytes() == b"three"
    assert write_file(agent, "empty.txt", b"")["ok"]
    assert (agent.home / "empty.txt").read_bytes() == b""
    (agent.home / "adir").mkdir()
    assert write_file(agent, "adir", b"x", overwrite=True)["error"]["kind"] == "is_directory"
    assert agent.ok("ping")[1]["pong"], "stray chunks of refused writes must be ignored"


def test_failed_write_leaves_nothing_behind(agent):
    req_id = agent.start("write_file", path="partial.bin", overwrite=False, size=10)
    agent.send(
        {"id": req_id, "op": "chunk", "data": base64.b64encode(b"12345").decode(), "last": True}
    )
    final = agent.wait(req_id)[1]
    assert final["error"]["kind"] == "bad_request", final
    assert os.listdir(agent.home) == []


def test_read_file_errors(agent):
    (agent.home / "big.bin").write_bytes(b"x" * 1000)
    final = agent.call("read_file", path="big.bin", max_bytes=999)
    assert final[0] == [], "nothing may be sent before too_large"
    assert final[1]["error"]["kind"] == "too_large"
    assert "1000" in final[1]["error"]["message"] and "999" in final[1]["error"]["message"]
    assert agent.call("read_file", path="missing", max_bytes=10)[1]["error"]["kind"] == "not_found"
    (agent.home / "d").mkdir()
    assert agent.call("read_file", path="d", max_bytes=10)[1]["error"]["kind"] == "is_directory"


def test_list_dir(agent):
    (agent.home / "b.txt").write_bytes(b"12345")
    (agent.home / "a").mkdir()
    os.symlink("/etc", agent.home / "c-link")
    _, result = agent.ok("list_dir", path=".")
    assert result["path"] == str(agent.home)
    entries = [(e["name"], e["type"]) for e in result["entries"]]
    assert entries == [("a", "dir"), ("b.txt", "file"), ("c-link", "symlink")]
    assert result["entries"][1]["size"] == 5
    assert isinstance(result["entries"][1]["modified"], float)
    _, default = agent.ok("list_dir")
    assert default["path"] == str(agent.home)
    assert agent.call("list_dir", path="b.txt")[1]["error"]["kind"] == "not_a_directory"
    assert agent.call("list_dir", path="nope")[1]["error"]["kind"] == "not_found"


@pytest.mark.parametrize(
    "path, kind",
    [
        ("../etc/passwd", "outside_home"),
        ("/etc/passwd", "outside_home"),
        ("sub/../../x", "outside_home"),
        ("etc-link/passwd", "outside_home"),
        ("passwd-link", "outside_home"),
        ("a\x00b", "bad_request"),
    ],
)
def test_paths_outside_home_are_refused(agent, path, kind):
    os.symlink("/etc", agent.home / "etc-link")
    os.symlink("/etc/passwd", agent.home / "passwd-link")
    (agent.home / "sub").mkdir()
    assert agent.call("read_file", path=path, max_bytes=MIB)[1]["error"]["kind"] == kind
    assert agent.call("list_dir", path=path)[1]["error"]["kind"] == kind
    final = write_file(agent, path, b"x", overwrite=True)
    assert final["error"]["kind"] == kind
    assert (
        agent.call("command", command="true", cwd=path, timeout_ms=1000)[1]["error"]["kind"] == kind
    )


def test_write_through_symlinked_parent_is_refused(agent):
    outside = agent.home.parent / "outside"
    outside.mkdir()
    os.symlink(outside, agent.home / "escape")
    assert write_file(agent, "escape/new.txt", b"x")["error"]["kind"] == "outside_home"
    assert write_file(agent, "escape/deeper/new.txt", b"x")["error"]["kind"] == "outside_home"
    assert list(outside.iterdir()) == []


def test_absolute_path_inside_home_is_accepted(agent):
    final = write_file(agent, str(agent.home / "abs.txt"), b"abs")
    assert final["ok"] and final["result"]["path"] == str(agent.home / "abs.txt")


# --------------------------------------------------------------------------------------------------
# Containment: the kernel is not the agent, nothing outlives its call


def alive(marker):
    """Pids of live (not zombie) processes whose command line contains `marker`."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state not in (b"Z", b"X"):
            found.append(int(name))
    return found


def gone_within(marker, seconds=5):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not alive(marker):
            return True
        time.sleep(0.05)
    return False


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


def test_the_kernel_does_not_load_the_package_index_relays_http_server(agent):
    # Only the agent serves the index; in the kernel (the same source) http.server and what it
    # pulls in (email, http.client, mimetypes) would cost ~2 MB for nothing.
    result, _ = agent.run("import sys\nsorted(m for m in ('http.server', 'email') if m in sys.modules)")
    assert result["result"]["text/plain"] == "[]", result


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


def test_a_background_job_survives_and_can_be_listed_and_killed(agent):
    marker = f"{os.getpid()}{time.monotonic_ns() % 100000}"
    _, started = agent.ok("command", command=f"sleep 4{marker}", background=True)
    job = started["job"]
    assert job["running"] is True and job["id"].startswith("job-"), job
    agent.ok("command", command="true", timeout_ms=5000)  # a sweep runs at its end
    assert alive(f"sleep 4{marker}"), "the job was killed by another call's sweep"
    jobs = agent.ok("jobs")[1]["jobs"]
    assert [j["id"] for j in jobs if j["running"]] == [job["id"]], jobs
    _, killed = agent.ok("kill_job", job=job["id"])
    assert killed["killed"] is True
    assert gone_within(f"sleep 4{marker}")
    assert agent.call("kill_job", job="job-999")[1]["error"]["kind"] == "not_found"


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


# --------------------------------------------------------------------------------------------------
# The package index relay (PROTOCOL.md, index_serve)


def relay_get(agent, path, timeout=90):
    """GET on the agent's loopback index; (status, reason, body)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", agent.ready["index_port"], timeout=timeout)
    try:
        conn.request("GET", path)
        answer = conn.getresponse()
        return answer.status, answer.reason, answer.read()
    finally:
        conn.close()


def open_index_serve(agent):
    """Opens an `index_serve` call and returns its id once the relay is open. The agent opens it
    when its reader thread takes the frame, which pip's request (another thread) could overtake:
    without a running call to ask, that request hears 503 at once. The reader handles frames in
    order, so the answer to a ping sent behind it means the serve call is open."""
    serve = agent.start("index_serve")
    agent.ok("ping")
    return serve


def test_the_index_relay_forwards_pip_requests_to_the_open_serve_call(agent):
    assert isinstance(agent.ready["index_port"], int), agent.ready
    serve = open_index_serve(agent)
    got = {}

    def fetch():
        got["answer"] = relay_get(agent, "/simple/sgdemo/")

    client = threading.Thread(target=fetch)
    client.start()
    q = agent._queue(serve)
    request = q.get(timeout=90)
    assert request["event"] == "index_request" and request["path"] == "/simple/sgdemo/", request
    body = b'{"files": []}'
    half = len(body) // 2
    for data, last, first in ((body[:half], False, True), (body[half:], True, False)):
        frame = {"id": serve, "op": "chunk", "rid": request["rid"], "last": last}
        frame["data"] = base64.b64encode(data).decode()
        if first:
            frame.update(status=200, content_type="application/vnd.pypi.simple.v1+json", length=len(body))
        agent.send(frame)
    client.join(90)
    assert got.get("answer") == (200, "OK", body), got

    # Closing the serve call (the gateway's interrupt) answers it; pip then hears 503.
    _, interrupted = agent.ok("interrupt", target=serve)
    assert interrupted == {"interrupted": True}
    _, final = agent.wait(serve)
    assert final["ok"] and final["result"]["served"] is True, final
    status, reason, text = relay_get(agent, "/simple/sgdemo/")
    assert status == 503 and b"only inside a call" in text, (status, reason, text)
    # The refusal is kept as a note for the pip wrapper.
    _, _, notes = relay_get(agent, "/_sandgate/notes?after=0")
    assert any("only inside a call" in n for n in json.loads(notes)["notes"]), notes


def test_pip_asks_a_running_call_to_open_the_relay_on_demand(agent):
    """The gateway opens no relay beside a call up front: pip's first request makes the agent send
    `index_wanted` on a running call, and the request goes through once a serve call opens."""
    mark = uuid.uuid4().hex
    cmd = agent.start(
        "command", command=f"export SANDGATE_TEST_MARK={mark}; sleep 1000", timeout_ms=100_000
    )
    wait_until(lambda: pids_with_mark(mark), 10, "command never started")
    got = {}

    def fetch():
        got["answer"] = relay_get(agent, "/simple/sgdemo/")

    client = threading.Thread(target=fetch)
    client.start()
    wanted = agent._queue(cmd).get(timeout=30)
    assert wanted == {"id": cmd, "event": "index_wanted"}, wanted
    serve = agent.start("index_serve")
    request = agent._queue(serve).get(timeout=30)
    assert request["event"] == "index_request" and request["path"] == "/simple/sgdemo/", request
    body = b"ok"
    agent.send(
        {"id": serve, "op": "chunk", "rid": request["rid"], "last": True, "status": 200,
         "content_type": "text/plain", "length": len(body), "data": base64.b64encode(body).decode()}
    )
    client.join(30)
    assert got.get("answer") == (200, "OK", body), got
    agent.ok("interrupt", target=serve)
    agent.ok("interrupt", target=cmd)
    agent.wait(cmd)


def test_pip_without_a_running_call_hears_503_at_once(agent):
    """Nobody to ask (pip in a background job between calls): refused without waiting."""
    status, _, text = relay_get(agent, "/simple/sgdemo/", timeout=5)
    assert status == 503 and b"only inside a call" in text, (status, text)


def test_the_index_relay_forwards_nothing_but_index_paths(agent):
    serve = open_index_serve(agent)
    for path in ("/etc/passwd", "/simple/../../x/", "/files/abc/x.whl", "/simple/a%20b/", "/" + "a" * 3000):
        status, _, _ = relay_get(agent, path)
        assert status == 404, path
    # Nothing reached the gateway.
    assert agent._queue(serve).empty()
    agent.ok("interrupt", target=serve)


def test_a_kernel_s_frames_and_exit_wait_until_the_agent_has_made_it_current():
    """A kernel that says ready (or dies) before the agent has recorded it as the current kernel
    must not be taken for a replaced one: its ready frame and its exit are handled only once the
    agent has decided (white-box: a stand-in kernel that says ready and exits at once)."""
    import importlib.util
    import types

    spec = importlib.util.spec_from_file_location("agent_under_test", AGENT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.CREDS = types.SimpleNamespace(popen_args=lambda: {})
    mod.KERNEL_ARGV = [
        sys.executable,
        "-c",
        "import os; fd = int(os.environ['SANDGATE_KERNEL_FDS'].split(',')[1]); "
        "os.write(fd, b'{\"event\": \"ready\"}\\n')",
    ]
    seen = queue.Queue()
    fake_agent = types.SimpleNamespace(
        on_kernel_line=lambda kp, line: seen.put(("line", line)),
        on_kernel_junk=lambda kp, why: seen.put(("junk", why)),
        on_kernel_exit=lambda kp, code: seen.put(("exit", code)),
    )
    kp = mod.KernelProcess(fake_agent)
    kp.proc.wait(timeout=30)
    time.sleep(0.5)  # time enough for the reader and the waiter to act, were they free to
    assert seen.empty(), "nothing is handled before the agent has decided"
    kp.decided.set()
    got = {seen.get(timeout=10), seen.get(timeout=10)}
    assert got == {("line", b'{"event": "ready"}'), ("exit", 0)}, got
    kp.kill()
