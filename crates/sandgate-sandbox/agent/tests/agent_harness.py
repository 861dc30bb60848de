"""The harness of the sandbox agent's behavioural tests (one test file per agent module, next to
this file): an agent started as a subprocess with a temporary home (SANDGATE_AGENT_HOME), and a
client of its protocol (PROTOCOL.md) that talks to it over stdin/stdout exactly as the gateway does.

The agent runs from the same zip archive the gateway builds (sandgate-sandbox's docker.rs: the
package and __main__.py, stored), built once per test session; either as a file (`python3 -u
<archive>`) or as the container runs it (`python3 -u -c <bootstrap.py> <archive, zlib, base64>`).
Every test runs under several kernels:

* ``ipython``: the interpreter running pytest, which must have IPython, numpy, pandas, matplotlib;
* ``plain``: the same interpreter with IPython made unimportable, so the plain-``exec`` fallback is
  exercised with the data stack present;
* ``bare``: /usr/bin/python3 when it lacks IPython (Debian's python3 without packages), if present.

Run:  scripts/agent-tests.sh  (or, in a virtualenv with pytest ipython numpy pandas matplotlib:
      python -m pytest -q crates/sandgate-sandbox/agent/tests)

AGENT_TEST_PYTHONS (colon-separated interpreter paths) replaces the list of interpreters; each is
then run as it is (kernel named after whether it can import IPython).
"""

import base64
import functools
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zipfile
import zlib
from pathlib import Path

import pytest

AGENT_DIR = Path(__file__).resolve().parent.parent
BOOTSTRAP = AGENT_DIR / "bootstrap.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MIB = 1 << 20


def archive_members():
    """The files of the agent's archive, as paths relative to AGENT_DIR: what docker.rs packs."""
    package = sorted(p.relative_to(AGENT_DIR) for p in (AGENT_DIR / "sandgate_agent").glob("*.py"))
    return [Path("__main__.py")] + package


@functools.lru_cache(maxsize=None)
def archive():
    """The agent's zip archive, built once per session."""
    path = Path(tempfile.mkdtemp(prefix="sandgate-agent-test-")) / "agent.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:
        for member in archive_members():
            zf.write(AGENT_DIR / member, member.as_posix())
    return path


@functools.lru_cache(maxsize=None)
def packed_archive():
    """The archive as it travels on the container's command line: compressed with zlib, then
    base64, as sandgate-sandbox's docker.rs does."""
    return base64.b64encode(zlib.compress(archive().read_bytes(), 9)).decode()


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

    def __init__(self, python, home, hide_ipython, workdir, via_c=False):
        env = dict(os.environ)
        env["SANDGATE_AGENT_HOME"] = str(home)
        env["HOME"] = str(home)
        # One matplotlib cache for the whole session: building its font cache takes seconds.
        env["MPLCONFIGDIR"] = str(workdir / "mplconfig")
        env.pop("PYTHONPATH", None)
        # Each agent's package index relay on a port of its own (tests run agents side by side).
        env["SANDGATE_AGENT_INDEX_PORT"] = "0"
        env["SANDGATE_AGENT_EGRESS_PORT"] = "0"
        # And a directory of its own for the egress CA bundle.
        env["SANDGATE_AGENT_EGRESS_DIR"] = str(home.parent / (home.name + "-egress"))
        if hide_ipython:
            stub = workdir / "no-ipython"
            (stub / "IPython").mkdir(parents=True, exist_ok=True)
            (stub / "IPython" / "__init__.py").write_text(
                "raise ImportError('IPython hidden by the agent tests')\n"
            )
            env["PYTHONPATH"] = str(stub)
        self.stderr_path = home.parent / f"agent-stderr-{uuid.uuid4().hex[:8]}.log"
        if not via_c:
            argv = [python, "-u", str(archive())]
        else:
            # The gateway starts the agent as `python3 -u -c <bootstrap.py> <archive>`.
            argv = [python, "-u", "-c", BOOTSTRAP.read_text(), packed_archive()]
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


def needs(agent, module):
    if module not in agent.ready["preloaded"]:
        pytest.skip(f"{module} not available in this interpreter")


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
