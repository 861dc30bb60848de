"""sandgate sandbox agent: the main process of every sandbox container.

It speaks the newline-delimited JSON protocol described in PROTOCOL.md (next to this file) over the
container's attached stdin/stdout. The same source runs in two roles:

* the **agent** (started by the gateway as ``python3 -u -c <bootstrap.py> <source>``, the source
  compressed (zlib, base64: bootstrap.py decompresses it), as root with
  only the capabilities SETUID, SETGID and KILL): owns the protocol descriptors, answers
  ``ping``, runs ``command`` (shell commands and background jobs), the file operations,
  ``interrupt`` and ``restart``, supervises the kernel, and ends every process a call leaves
  behind;
* the **kernel** (``python3 -u -c <bootstrap.py> <source> kernel``, started by the agent as uid 1000
  with no capabilities): runs the Python cells (an IPython ``InteractiveShell`` when IPython is
  importable, plain ``exec`` otherwise) and talks to the agent over a private pair of pipes.

User code (cells and commands) runs as uid 1000 and therefore can neither open the agent's
descriptors under /proc, nor signal it, nor write a frame the gateway reads: the agent only relays
kernel frames that belong to the cell the kernel is running. When the kernel dies (a segfault,
``os._exit``, ``kill -9``, the out-of-memory killer) the agent says why, starts a fresh kernel, and
files in the home directory stay.

It is stdlib-only on purpose: the Rust gateway embeds this file, so any image with python3 can be a
sandbox profile. IPython, numpy, pandas and matplotlib are used when present and skipped when not.

Environment: ``SANDGATE_AGENT_HOME`` overrides the home directory (default ``/home/user``), so the
agent can be tested on a host (then, not being root, it runs the kernel and commands as its own
user, and it ends leftover processes among its own descendants only).
"""

import ast
import base64
import binascii
import codecs
import collections
import ctypes
import errno
import fcntl
import hashlib
import importlib
import io
import json
import linecache
import os
import platform
import queue
import re
import select
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
import urllib.parse

# http.server is imported where the agent starts the package index relay (IndexRelay.start), not
# here: the kernel runs this same source and never serves the index, and the import (with email,
# http.client, socketserver, mimetypes …) costs each process ~2.8 MB.

PROTOCOL_VERSION = 2

HOME = os.path.realpath(os.environ.get("SANDGATE_AGENT_HOME") or "/home/user")

# The sandbox user: cells and commands run as this uid/gid (when the agent runs as root).
USER_UID = 1000
USER_GID = 1000

# Defaults for arguments the gateway normally always sends.
DEFAULT_OUTPUT_LIMIT = 1 << 20
# Room kept beyond a call's output limit for the truncation marker and JSON framing.
MARKER_SLACK = 4096
# Decoded image bytes one cell may send (PNG charts); more are dropped and the cell is truncated.
DISPLAY_LIMIT = 32 << 20
# File data travels in chunks of at most this many raw bytes (PROTOCOL.md, read_file).
CHUNK_SIZE = 256 * 1024
# A frame longer than this is refused instead of buffered: one huge line must not exhaust memory.
# It is far above the largest legitimate frame (a write chunk of 256 KiB is ~350 KB of base64, a
# cell's source is rarely more than a few MB).
MAX_FRAME_BYTES = 64 << 20
# Chunks of a write_file wait in a bounded queue so a slow disk pushes back on the gateway instead of
# the agent buffering an entire upload in memory.
WRITE_QUEUE_CHUNKS = 32
# An upload whose next chunk does not arrive within this time is abandoned (temp file removed).
WRITE_IDLE_TIMEOUT_S = 300.0
# After a command's main process has exited we still collect what is already in its pipes, but do
# not wait longer than this for EOF (a process that escaped the group may hold the pipe open).
COMMAND_DRAIN_S = 0.2
# How long a sweep keeps killing leftover processes (a fork loop races it) before giving up.
SWEEP_S = 2.0
# Most background jobs running at once.
MAX_JOBS = 8
# Where a background job's output goes (created by the job itself, as the sandbox user).
JOBS_DIR = "/tmp/sandgate-jobs"
# How long, after the kernel exited, the agent waits to have read every frame it wrote.
READ_AFTER_EXIT_S = 2.0
# How long a fresh kernel may take to say ready (it preloads the data stack first).
KERNEL_READY_S = 120.0

# The kernel's end of its pipes to the agent, named in its environment: "<input fd>,<output fd>".
ENV_KERNEL_FDS = "SANDGATE_KERNEL_FDS"

ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def strip_ansi(text):
    return ANSI_ESCAPE.sub("", text)


# --------------------------------------------------------------------------------------------------
# Protocol output


class ProtocolWriter:
    """Writes frames to a private descriptor (the agent: the container's stdout; the kernel: its
    pipe to the agent).

    Many threads emit frames, so one lock serialises them, and each frame is written as one complete
    line with a single write call (looping only if the kernel accepts part of it), so frames never
    interleave.
    """

    def __init__(self, fd):
        self.fd = fd
        self.lock = threading.Lock()

    def send(self, obj):
        # ensure_ascii=False + errors="replace": a lone surrogate in user data (e.g. the repr of
        # "\ud800") becomes "?" instead of a "\ud800" escape that strict JSON parsers (serde_json)
        # reject.
        line = (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode(
            "utf-8", "replace"
        )
        self.send_line(line)

    def send_line(self, line):
        with self.lock:
            view = memoryview(line)
            try:
                while view:
                    written = os.write(self.fd, view)
                    view = view[written:]
            except OSError as err:
                # The other side is gone: nobody can receive results any more.
                log(f"protocol output failed ({err}); exiting")
                shutdown(1)

    def ok(self, req_id, result):
        self.send({"id": req_id, "ok": True, "result": result})

    def error(self, req_id, kind, message):
        self.send({"id": req_id, "ok": False, "error": {"kind": kind, "message": message}})

    def event(self, req_id, event, **fields):
        frame = {"id": req_id, "event": event}
        frame.update(fields)
        self.send(frame)


WRITER = None  # ProtocolWriter, set in main()
LOG_FD = None  # the agent: duplicate of the original stderr (the container log); set in main()


def log(message):
    """Agent diagnostics go to the original stderr, i.e. the container log, never the protocol."""
    if LOG_FD is None:
        return
    try:
        os.write(LOG_FD, f"sandgate-agent: {message}\n".encode("utf-8", "replace"))
    except OSError:
        pass


class OpError(Exception):
    """A request failed; becomes an `{"ok": false, "error": {kind, message}}` final frame."""

    def __init__(self, kind, message):
        super().__init__(message)
        self.kind = kind
        self.message = message


# --------------------------------------------------------------------------------------------------
# Credentials and processes


class Credentials:
    """Who the agent is and how it acts as the sandbox user.

    As root (in a container), file operations run on a thread whose effective uid/gid are switched to
    the sandbox user's with the raw setresuid/setresgid system calls: those change one thread only
    (glibc's wrappers would change every thread), so the file operation is checked, and creates
    files, exactly as the user would, while the rest of the agent stays root. Child processes get the
    user's uid/gid in full, which also clears every capability.
    """

    # (setresuid, setresgid) system call numbers per architecture.
    SYSCALLS = {"x86_64": (117, 119), "aarch64": (147, 149), "arm64": (147, 149)}

    def __init__(self):
        # On a host (SANDGATE_AGENT_HOME set, the tests) the agent never switches users, even as
        # root: there is no sandbox user there, and sweeping "all uid-1000 processes" would be wrong.
        self.root = os.geteuid() == 0 and "SANDGATE_AGENT_HOME" not in os.environ
        self.libc = None
        if self.root:
            numbers = self.SYSCALLS.get(platform.machine())
            if numbers is None:
                raise RuntimeError(f"unsupported architecture {platform.machine()}")
            self.setresuid, self.setresgid = numbers
            self.libc = ctypes.CDLL(None, use_errno=True)
            os.setgroups([])  # root's supplementary groups must not apply to user-context checks
            # Not dumpable: /proc/<agent>/fd and /mem stay closed to other uids whatever the
            # kernel's (or gVisor's) ptrace-access rules say about root processes.
            self.libc.prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE

    def popen_args(self):
        """Arguments for subprocess.Popen that start a process as the sandbox user."""
        if not self.root:
            return {}
        return {"user": USER_UID, "group": USER_GID, "extra_groups": []}

    def _switch(self, uid, gid):
        def call(number, value):
            if self.libc.syscall(number, -1, value, -1) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"switching the thread's credentials failed: {os.strerror(err)}")

        if uid == 0:
            call(self.setresuid, 0)
            call(self.setresgid, 0)
        else:
            call(self.setresgid, gid)
            call(self.setresuid, uid)

    def run_as_user(self, target, *args):
        """Calls target(*args) with this thread acting as the sandbox user."""
        if not self.root:
            return target(*args)
        self._switch(USER_UID, USER_GID)
        try:
            return target(*args)
        finally:
            self._switch(0, 0)


CREDS = None  # Credentials, set in agent_main()


ProcInfo = collections.namedtuple("ProcInfo", "ppid uid state sid")


def read_processes():
    """pid -> ProcInfo(ppid, real uid, state, session id) of every process visible in /proc."""
    procs = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                data = f.read()
            # After "(comm)": state, ppid, pgrp, session, ...
            fields = data[data.rindex(b")") + 2 :].split()
            state, ppid, sid = fields[0].decode(), int(fields[1]), int(fields[3])
            uid = None
            with open(f"/proc/{pid}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"Uid:"):
                        uid = int(line.split()[1])
                        break
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        procs[pid] = ProcInfo(ppid, uid, state, sid)
    return procs


def tree(procs, roots):
    """The pids in `roots` and all their descendants."""
    children = collections.defaultdict(list)
    for pid, info in procs.items():
        children[info.ppid].append(pid)
    seen = set()
    todo = [pid for pid in roots if pid in procs]
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        todo.extend(children.get(pid, ()))
    return seen


def belonging(procs, roots):
    """The processes of the calls whose main processes are `roots` (the kernel, commands, jobs):
    each root's tree, and every process of the session the root leads, with its tree.

    Every root leads a session of its own (start_new_session). A process orphaned by a double fork
    or `nohup … &` is reparented out of its call's tree but keeps the call's session, so a sweep
    after *another* call spares it while its own call runs. Only `setsid` leaves the session;
    what also leaves the tree then belongs to no call (PROTOCOL.md, "Sweeps").
    """
    sessions = {pid for pid in roots if pid in procs and procs[pid].sid == pid}
    members = [pid for pid, info in procs.items() if info.sid in sessions]
    return tree(procs, list(roots) + members)


# Starting a user process and recording it where `keep_roots` finds it happen under SPAWN_LOCK,
# and each round of a sweep decides and kills under it: a sweep (another call ending) never sees a
# process that was started but not yet recorded, and so never kills a call that is just starting.
SPAWN_LOCK = threading.Lock()


def sweep(keep_roots, keep_pids=()):
    """Kills every user process that does not belong to one of `keep_roots()` (the kernel, running
    commands, background jobs: asked again each round, under SPAWN_LOCK; see `belonging`) nor is
    one of `keep_pids`, repeating until none is left or SWEEP_S has passed.

    As root the candidates are all processes of the sandbox user, wherever they were reparented
    (setsid, double fork, nohup: none of them changes the uid); on a host (tests), the agent's own
    descendants. Returns the number of processes killed.
    """
    me = os.getpid()
    deadline = time.monotonic() + SWEEP_S
    killed = 0
    while True:
        with SPAWN_LOCK:
            procs = read_processes()
            keep = belonging(procs, keep_roots()) | {me} | set(keep_pids)
            if CREDS is not None and CREDS.root:
                candidates = {pid for pid, info in procs.items() if info.uid == USER_UID}
            else:
                candidates = tree(procs, [me])
            victims = [pid for pid in candidates - keep if procs[pid].state not in ("Z", "X")]
            if not victims:
                return killed
            for pid in victims:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
                except (ProcessLookupError, PermissionError):
                    pass
        if time.monotonic() >= deadline:
            log(f"sweep gave up with {len(victims)} processes left")
            return killed
        time.sleep(0.01)


def kill_group(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def leader_exited(pid):
    """True once `pid` has exited, without reaping it.

    WNOWAIT leaves the process a zombie, so its pid, which is also the id of its process group,
    cannot be taken by an unrelated process before we have killed the group.
    """
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def user_env(extra=None):
    """The environment of user processes: nothing of the agent's own."""
    env = {
        "HOME": HOME,
        "USER": "user",
        "LOGNAME": "user",
        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "LANG": os.environ.get("LANG", "C.UTF-8"),
        "MPLBACKEND": "Agg",
        "PYTHONUNBUFFERED": "1",
        # IPython wants a writable profile directory; keep it out of the user's home (and quota).
        "IPYTHONDIR": os.path.join(tempfile.gettempdir(), "sandgate-ipython"),
        # pip installs the user's packages here (pip.conf: user = true), outside the home.
        "PYTHONUSERBASE": PACKAGES_BASE,
    }
    env["PATH"] = os.path.join(PACKAGES_BASE, "bin") + ":" + env["PATH"]
    for name in ("SANDGATE_AGENT_HOME", "MPLCONFIGDIR", "PYTHONPATH", "IPYTHONDIR", "LC_ALL", "TZ"):
        if name in os.environ:
            env[name] = os.environ[name]
    env.update(extra or {})
    return env


# What the model is told when the sandbox's process limit stops the agent from starting something.
AT_PROCESS_LIMIT = (
    "the sandbox is at its process limit (too many processes or threads, e.g. a fork bomb); end "
    "what holds them (kill_job for a background job) and retry"
)


def describe_exit(returncode, oom_before, pids_before=None):
    """Why the kernel ended, in words for the model."""
    oom_after = oom_kills()
    pids_after = pids_refusals()
    at_pids_limit = (
        pids_before is not None and pids_after is not None and pids_after > pids_before
    )
    if oom_before is not None and oom_after is not None and oom_after > oom_before:
        return (
            "the Python kernel was killed by the out-of-memory killer: the sandbox's memory limit "
            "was reached"
        )
    if returncode < 0:
        sig = -returncode
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        if sig == signal.SIGKILL:
            hint = (
                " (by user code, e.g. `kill -9`)"
                if oom_after is not None
                else " (by user code, or by the out-of-memory killer at the sandbox's memory limit)"
            )
        else:
            hint = {
                signal.SIGSEGV: " (a crash, e.g. in a C extension)",
                signal.SIGABRT: " (an abort, e.g. in a C extension)",
            }.get(sig, "")
        return f"the Python kernel was killed by {name}{hint}"
    if at_pids_limit:
        # numpy's thread pool, for one, ends the process when it cannot start its threads.
        return (
            f"the Python kernel exited with status {returncode} while the sandbox was at its "
            "process limit (too many processes or threads, e.g. a fork bomb): it could not start "
            "a thread or process it needed"
        )
    return f"the Python kernel exited with status {returncode} (e.g. os._exit or sys.exit outside a cell)"


def cgroup_counter(paths, key):
    """The counter `key` of the first readable cgroup event file in `paths` (lines of "<key>
    <count>"), None when none can be read."""
    for path in paths:
        try:
            with open(path) as f:
                for line in f:
                    if line.startswith(key + " "):
                        return int(line.split()[1])
        except (OSError, ValueError):
            continue
    return None


def pids_refusals():
    """How often the container's process limit has refused a new process or thread (cgroup v2 or
    v1), None when it cannot be read."""
    return cgroup_counter(("/sys/fs/cgroup/pids.events", "/sys/fs/cgroup/pids/pids.events"), "max")


def oom_kills():
    """The container's out-of-memory kill count (cgroup v2 or v1), None when it cannot be read."""
    return cgroup_counter(
        ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"), "oom_kill"
    )


# --------------------------------------------------------------------------------------------------
# Output capture


class OutputSink:
    """Turns the raw output of one request (an exec or a command) into stdout/stderr events.

    It enforces the per-call output limit (stdout and stderr together) and emits the truncation
    marker once. Decoding is incremental per stream, so a UTF-8 sequence split across two reads is
    not mangled.
    """

    def __init__(self, req_id, limit):
        self.req_id = req_id
        self.limit = max(0, limit)
        self.count = 0
        self.truncated = False
        self.decoders = {}

    def feed(self, stream, data):
        if self.truncated:
            return  # keep draining the pipe, but drop the bytes
        room = self.limit - self.count
        if len(data) > room:
            data = data[:room]
            self.truncated = True
        self.count += len(data)
        self._emit(stream, data, final=self.truncated)
        if self.truncated:
            WRITER.event(
                self.req_id,
                "stderr",
                data=f"\n[output truncated: limit of {self.limit} bytes reached]\n",
            )

    def finish(self):
        """Flushes bytes held back by the decoders (an incomplete UTF-8 sequence at the end)."""
        if not self.truncated:
            for stream in list(self.decoders):
                self._emit(stream, b"", final=True)

    def _emit(self, stream, data, final):
        decoder = self.decoders.get(stream)
        if decoder is None:
            decoder = self.decoders[stream] = codecs.getincrementaldecoder("utf-8")("replace")
        text = decoder.decode(data, final)
        if text:
            WRITER.event(self.req_id, stream, data=text)


class FdCapture:
    """Points fd 1 and fd 2 at pipes and attributes what arrives there to the running exec.

    Capturing at the fd level (rather than replacing sys.stdout) is what makes the output of child
    processes (os.system, subprocess) visible too. A pump thread per pipe reads and emits; the main
    thread can `drain()` under the same lock to be sure everything written so far has been emitted
    before it sends a display event or the final frame, which keeps events in order.
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.sink = None
        self.fds = {}
        for target, stream in ((1, "stdout"), (2, "stderr")):
            read_fd, write_fd = os.pipe()
            try:
                # A bigger pipe means fewer wake-ups for chatty cells; not essential.
                fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, 1 << 20)
            except (OSError, AttributeError):
                pass
            os.dup2(write_fd, target)  # fd 1/2 stay inheritable so child processes write here
            os.close(write_fd)
            os.set_blocking(read_fd, False)
            self.fds[read_fd] = stream
        for read_fd in self.fds:
            threading.Thread(
                target=self._pump, args=(read_fd,), name=f"pump-{self.fds[read_fd]}", daemon=True
            ).start()

    def _pump(self, read_fd):
        poller = select.poll()
        poller.register(read_fd, select.POLLIN)
        while True:
            poller.poll()
            with self.lock:
                self._read_available(read_fd, max_reads=1)

    def _read_available(self, read_fd, max_reads):
        for _ in range(max_reads):
            try:
                data = os.read(read_fd, 1 << 20)
            except BlockingIOError:
                return
            except InterruptedError:
                continue
            if not data:
                return
            # Output written while no exec is running (a background thread of an earlier cell, the
            # preloads' warnings) belongs to no request and is dropped: writing it to the container
            # log could block the pump if nobody drains that log.
            if self.sink is not None:
                self.sink.feed(self.fds[read_fd], data)

    def drain(self):
        """Emits everything written to fd 1/2 so far (by this process and its children)."""
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a user may have replaced sys.stdout with anything
                pass
        with self.lock:
            # A pipe holds at most 1 MiB, so a bounded number of reads empties what was written
            # before this call; the bound keeps a background writer from holding us here forever.
            for read_fd in self.fds:
                self._read_available(read_fd, max_reads=64)

    def attach(self, sink):
        with self.lock:
            self.sink = sink

    def detach(self):
        self.drain()
        with self.lock:
            if self.sink is not None:
                self.sink.finish()
            self.sink = None


# --------------------------------------------------------------------------------------------------
# Paths (PROTOCOL.md, "Paths")
#
# Confinement is checked on the resolved path. File operations run acting as the sandbox user (see
# Credentials), so this is a guard against gateway/model mistakes, not a security boundary against
# code in the sandbox: a cell racing a symlink swap against a file op only reaches what it could
# reach anyway.


def resolve_path(path, default="."):
    if path is None:
        path = default
    if not isinstance(path, str):
        raise OpError("bad_request", "path must be a string")
    if "\x00" in path:
        raise OpError("bad_request", "path contains a NUL byte")
    if path == "":
        path = "."
    # An absolute path replaces HOME in the join; realpath then resolves "..", and every symlink
    # along the way (a symlinked parent directory included).
    real = os.path.realpath(os.path.join(HOME, path))
    if real != HOME and not real.startswith(HOME + os.sep):
        raise OpError("outside_home", f"path {path!r} is outside {HOME}")
    return real


def io_error(err, path):
    """Maps an OSError to the protocol's error kinds."""
    mapping = {
        errno.ENOENT: "not_found",
        errno.EISDIR: "is_directory",
        errno.ENOTDIR: "not_a_directory",
        errno.EEXIST: "exists",
    }
    kind = mapping.get(err.errno, "io")
    return OpError(kind, f"{path}: {err.strerror or err}")


# --------------------------------------------------------------------------------------------------
# Matplotlib


class Figures:
    """Turns matplotlib figures into display events and PNG files under <home>/outputs."""

    def __init__(self, capture):
        self.capture = capture
        self.req_id = None
        self.execution_count = 0
        self.index = 0

    def begin(self, req_id, execution_count):
        self.req_id = req_id
        self.execution_count = execution_count
        self.index = 0

    def end(self):
        self.req_id = None

    def patch_pyplot(self):
        """Replaces plt.show (a no-op warning under Agg) with one that emits the open figures."""
        plt = loaded_module("matplotlib.pyplot")
        if plt is None or getattr(plt.show, "_sandgate", False):
            return

        def show(*args, **kwargs):
            self.flush()

        show._sandgate = True
        show.__doc__ = "Display all open figures (sandgate: as display events) and close them."
        plt.show = show

    def flush(self):
        """Emits every open figure and closes it."""
        plt = loaded_module("matplotlib.pyplot")
        if plt is None or self.req_id is None:
            return
        for num in plt.get_fignums():
            fig = plt.figure(num)
            try:
                self._emit(fig)
            finally:
                plt.close(fig)

    def _emit(self, fig):
        buf = io.BytesIO()
        # bbox_inches="tight" is what Jupyter's inline backend uses: no large empty margins.
        fig.savefig(buf, format="png", bbox_inches="tight")
        png = buf.getvalue()
        self.index += 1
        path = None
        try:
            outputs = os.path.join(HOME, "outputs")
            os.makedirs(outputs, exist_ok=True)
            candidate = os.path.join(outputs, f"figure-{self.execution_count}-{self.index}.png")
            with open(candidate, "wb") as f:
                f.write(png)
            path = candidate
        except OSError as err:  # e.g. quota exceeded: the chart is still shown
            print(f"[figure not saved: {err}]", file=sys.stderr)
        # Output printed before the figure must arrive before it.
        self.capture.drain()
        fields = {
            "data": {"image/png": base64.b64encode(png).decode("ascii"), "text/plain": repr(fig)}
        }
        if path is not None:
            fields["path"] = path
        WRITER.event(self.req_id, "display", **fields)


def mime_bundle(format_dict):
    """Makes a formatter's output JSON-safe: bytes become base64, unserialisable values are dropped."""
    bundle = {}
    for mime, value in (format_dict or {}).items():
        if isinstance(value, str):
            bundle[mime] = value
        elif isinstance(value, (bytes, bytearray)):
            bundle[mime] = base64.b64encode(value).decode("ascii")
        else:
            try:
                json.dumps(value, allow_nan=False)
            except (TypeError, ValueError):
                continue
            bundle[mime] = value
    return bundle


# --------------------------------------------------------------------------------------------------
# Preloading the data stack (after ready, in the background)

# What the kernel imports in the background once it has said ready, in this order.
PRELOAD = ("numpy", "pandas", "matplotlib")


def module_present(name):
    """Whether a top-level module can be found, without importing it (cheap: a path scan)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def loaded_module(name):
    """The module if it is fully imported; None while another thread is still importing it (its
    attributes may not exist yet) or when nobody imported it."""
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    if module is None or getattr(spec, "_initializing", False):
        return None
    return module


class ThreadMuted:
    """A stand-in for sys.stdout/sys.stderr that drops what one thread writes and passes the rest
    (every other thread's writes, attributes, flush) to the stream it wraps."""

    def __init__(self, inner, muted_thread):
        self.inner = inner
        self.muted_thread = muted_thread

    def write(self, data):
        if threading.get_ident() == self.muted_thread:
            return len(data)
        return self.inner.write(data)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def __getattr__(self, name):
        return getattr(self.inner, name)


# --------------------------------------------------------------------------------------------------
# Kernels


class IPythonKernel:
    """Runs cells in an IPython InteractiveShell, the way a Jupyter kernel would (minus ZMQ)."""

    def __init__(self, figures):
        from IPython.core.displayhook import DisplayHook
        from IPython.core.displaypub import DisplayPublisher
        from IPython.core.interactiveshell import InteractiveShell
        from traitlets.config import Config

        kernel = self

        class QuietDisplayHook(DisplayHook):
            # The stock hook prints "Out[n]: ..." to stdout; the value belongs in the result instead.
            def write_output_prompt(self):
                pass

            def write_format_data(self, format_dict, md_dict=None):
                kernel.last_value = mime_bundle(format_dict)

            def finish_displayhook(self):
                pass

        class EventDisplayPublisher(DisplayPublisher):
            # display(obj) in a cell becomes a display event instead of text on stdout.
            def publish(self, data, metadata=None, source=None, **kwargs):
                if figures.req_id is None:
                    return
                figures.capture.drain()
                WRITER.event(figures.req_id, "display", data=mime_bundle(data))

            def clear_output(self, wait=False):
                pass

        class AgentShell(InteractiveShell):
            # The hook ipykernel uses too: take the traceback instead of printing it to stdout.
            def _showtraceback(self, etype, evalue, stb):
                lines = [strip_ansi(line) for line in stb]
                kernel.last_error = {
                    "name": etype.__name__,
                    "value": str(evalue),
                    # The SIGINT handler's frame is the agent's, not the user's (IPython's
                    # __tracebackhide__ never hides the innermost frame, so filter it here).
                    "traceback": [
                        line for line in lines if not (AGENT_FILE in line and "on_sigint" in line)
                    ],
                }

        config = Config()
        # History in memory: the home directory is the user's and may be on a quota.
        config.HistoryManager.hist_file = ":memory:"
        self.shell = AgentShell.instance(
            config=config,
            displayhook_class=QuietDisplayHook,
            display_pub_class=EventDisplayPublisher,
            # Lower case is valid for both IPython 8 (caseless enum) and 9 (lower-case names).
            colors="nocolor",
        )
        register_pip_magic(self.shell)
        self.last_value = None
        self.last_error = None

    def next_count(self):
        return self.shell.execution_count

    def run(self, code):
        self.last_value = None
        self.last_error = None
        outcome = self.shell.run_cell(code, store_history=True)
        error = self.last_error
        exc = outcome.error_before_exec or outcome.error_in_exec
        if exc is not None and error is None:
            # e.g. a UsageError from a magic, which IPython reports without a traceback.
            error = {"name": type(exc).__name__, "value": str(exc), "traceback": []}
        return self.last_value, error


class PlainKernel:
    """Fallback when IPython is missing: exec with the value of a trailing expression captured."""

    def __init__(self):
        import builtins

        # A real module registered as __main__, so pickle and dataclasses can find user classes.
        self.module = types.ModuleType("__main__")
        self.module.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = self.module
        self.ns = self.module.__dict__
        self.count = 1

    def next_count(self):
        return self.count

    def run(self, code):
        filename = f"<cell-{self.count}>"
        self.count += 1
        # Register the source so tracebacks show the offending lines.
        lines = code.splitlines(True)
        linecache.cache[filename] = (len(code), None, lines, filename)
        try:
            tree = ast.parse(code, filename, "exec")
            last = None
            if tree.body and isinstance(tree.body[-1], ast.Expr):
                last = ast.Expression(tree.body.pop().value)
            body = compile(tree, filename, "exec")
            tail = compile(last, filename, "eval") if last is not None else None
        except (SyntaxError, ValueError, OverflowError) as exc:
            return None, self._error(exc, None)
        try:
            exec(body, self.ns)
            value = eval(tail, self.ns) if tail is not None else None
        except BaseException as exc:  # KeyboardInterrupt and SystemExit too: the kernel lives on
            return None, self._error(exc, exc.__traceback__)
        if value is None:
            return None, None
        self.ns["_"] = value
        return self._format(value), None

    def _format(self, value):
        bundle = {"text/plain": repr(value)}
        html = getattr(value, "_repr_html_", None)
        if callable(html):
            try:
                rendered = html()
            except Exception:
                rendered = None
            if isinstance(rendered, str):
                bundle["text/html"] = rendered
        return bundle

    @staticmethod
    def _error(exc, tb):
        # Drop the agent's own frames: the traceback starts in the cell.
        while tb is not None and not tb.tb_frame.f_code.co_filename.startswith("<cell-"):
            tb = tb.tb_next
        report = traceback.TracebackException(type(exc), exc, tb, compact=True)
        # The SIGINT handler's frame is the agent's, not the user's.
        report.stack = traceback.StackSummary.from_list(
            [f for f in report.stack if not (f.filename == AGENT_FILE and f.name == "on_sigint")]
        )
        lines = list(report.format())
        return {
            "name": type(exc).__name__,
            "value": str(exc),
            "traceback": [line.rstrip("\n") for line in lines],
        }


# --------------------------------------------------------------------------------------------------
# Frames in


class FrameServer:
    """Reads newline-delimited JSON requests from a descriptor and calls `op_<name>` for each."""

    def __init__(self, proto_in):
        self.proto_in = proto_in
        self.buffer = bytearray()
        self.scanned = 0  # bytes of buffer already known to hold no newline

    def read_frames(self):
        """Yields raw lines from the protocol input; None for a line too long to accept."""
        while True:
            newline = self.buffer.find(b"\n", self.scanned)
            if newline >= 0:
                line = bytes(self.buffer[:newline])
                del self.buffer[: newline + 1]
                self.scanned = 0
                yield line
                continue
            self.scanned = len(self.buffer)
            if len(self.buffer) > MAX_FRAME_BYTES:
                # Discard up to the end of the oversized line, then report it once.
                self.buffer.clear()
                self.scanned = 0
                while True:
                    data = self._read_input()
                    if not data:
                        return
                    newline = data.find(b"\n")
                    if newline >= 0:
                        self.buffer += data[newline + 1 :]
                        break
                yield None
                continue
            data = self._read_input()
            if not data:
                return
            self.buffer += data

    def _read_input(self):
        while True:
            try:
                return os.read(self.proto_in, 1 << 20)
            except InterruptedError:
                continue

    def reader_loop(self):
        for line in self.read_frames():
            try:
                self.handle_line(line)
            except Exception as err:  # bad input must never kill the agent
                log(f"frame handling failed: {traceback.format_exc()}")
                WRITER.error(None, "internal", f"agent error: {err!r}")
        # Protocol input closed: the other side is gone for good (PROTOCOL.md: exit on EOF).
        shutdown(0)

    def handle_line(self, line):
        if line is None:
            WRITER.error(None, "bad_request", f"frame longer than {MAX_FRAME_BYTES} bytes")
            return
        if not line.strip():
            return
        try:
            frame = json.loads(line)
        except ValueError as err:  # also UnicodeDecodeError
            WRITER.error(None, "bad_request", f"frame is not valid JSON: {err}")
            return
        if not isinstance(frame, dict):
            WRITER.error(None, "bad_request", "frame is not a JSON object")
            return
        req_id = frame.get("id")
        op = frame.get("op")
        if op == "chunk":
            if not isinstance(req_id, (dict, list)):
                self.route_chunk(req_id, frame)
            return
        try:
            if req_id is None or isinstance(req_id, (dict, list)):
                raise OpError("bad_request", "request has no valid id")
            handler = getattr(self, f"op_{op}", None) if isinstance(op, str) else None
            if handler is None:
                raise OpError("bad_request", f"unknown op {op!r}")
            self.dispatch_op(op, handler, req_id, frame)
        except OpError as err:
            WRITER.error(req_id, err.kind, err.message)
        except Exception as err:  # an agent bug: this request fails, the agent lives on
            log(f"{op} failed: {traceback.format_exc()}")
            WRITER.error(req_id, "internal", f"agent error: {err!r}")

    def dispatch_op(self, op, handler, req_id, frame):
        handler(req_id, frame)

    def route_chunk(self, req_id, frame):
        pass

    def spawn(self, name, target, req_id, *args, as_user=False):
        """Runs a request on its own thread; its OpError or crash becomes the final frame."""

        def run():
            try:
                if as_user:
                    CREDS.run_as_user(target, req_id, *args)
                else:
                    target(req_id, *args)
            except OpError as err:
                WRITER.error(req_id, err.kind, err.message)
            except Exception as err:
                log(f"{name} failed: {traceback.format_exc()}")
                WRITER.error(req_id, "internal", f"agent error: {err!r}")

        try:
            threading.Thread(target=run, name=f"{name}-{req_id}", daemon=True).start()
        except RuntimeError:
            raise OpError("limit", AT_PROCESS_LIMIT + ": this request cannot start now") from None


# --------------------------------------------------------------------------------------------------
# The kernel process (uid 1000): cells


class CellRunner(FrameServer):
    """The kernel role: runs `exec` requests from the agent on its main thread, one at a time."""

    def __init__(self, proto_in):
        super().__init__(proto_in)
        self.main_ident = threading.get_ident()
        self.state_lock = threading.Lock()
        self.exec_queue = collections.deque()
        self.exec_ready = threading.Condition(self.state_lock)
        self.running_exec = None  # id of the exec running on the main thread
        self.interruptible = False  # True only while user code runs (see on_sigint)
        # Set by `interrupt` for the running exec: covers an interrupt that arrives after the cell
        # was taken from the queue but before its code started (the signal alone would be dropped).
        self.interrupt_requested = False
        # Set when on_sigint has actually raised KeyboardInterrupt for the current interrupt.
        self.interrupt_delivered = False
        self.interrupt_target = None  # the last cell the agent asked to interrupt
        self.capture = None
        self.figures = None
        self.kernel = None
        self.preloaded = []

    def start(self):
        self.capture = FdCapture()
        # The agent passes -u; should it not, print output would wait in Python's buffer and
        # arrive after that of child processes. (Harmless when -u already made it unbuffered.)
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=True)
        try:
            os.chdir(HOME)
        except OSError as err:
            print(f"cannot enter {HOME}: {err}", file=sys.stderr)
        os.environ["MPLBACKEND"] = "Agg"
        self.figures = Figures(self.capture)
        # Ready before anything heavy is imported: a cell sent now waits in the queue until the
        # shell exists (warm_up), and one that uses the data stack waits, in Python's per-module
        # import lock, only for the modules it imports (see preload_in_background).
        self.preloaded = [name for name in PRELOAD if module_present(name)]
        WRITER.send(
            {
                "event": "ready",
                "pid": os.getpid(),
                "python": platform.python_version(),
                "ipython": module_present("IPython"),
                "preloaded": self.preloaded,
                "next_count": 1,
            }
        )

    def warm_up(self):
        """After ready: creates the shell (IPython when importable) on the main thread, then
        imports the data stack in the background while cells run."""
        try:
            self.kernel = IPythonKernel(self.figures)
        except ImportError:
            self.kernel = PlainKernel()
        except Exception:  # a broken IPython install must not take the sandbox down
            self.kernel = PlainKernel()
        signal.signal(signal.SIGINT, self.on_sigint)
        try:
            threading.Thread(target=self.preload_in_background, name="preload", daemon=True).start()
        except RuntimeError as err:  # at the process limit: cells import what they use themselves
            log(f"no background import of the data stack: {err!r}")

    def preload_in_background(self):
        """Imports numpy, pandas and matplotlib so that a leased sandbox's cells find them loaded.

        A cell that imports one of them meanwhile blocks in the import system's lock for that module
        until this thread has finished it, then sees the complete module: it waits only for what it
        uses. What this thread prints through sys.stdout/sys.stderr (warnings, say) is dropped, never
        mixed into a running cell's output.
        """
        me = threading.get_ident()
        quiet = [ThreadMuted(sys.stdout, me), ThreadMuted(sys.stderr, me)]
        sys.stdout, sys.stderr = quiet
        try:
            for name in self.preloaded:
                try:
                    if name == "matplotlib":
                        import matplotlib

                        matplotlib.use("Agg")
                        import matplotlib.pyplot  # noqa: F401  (the slow part of the import)

                        self.figures.patch_pyplot()
                    else:
                        __import__(name)
                except Exception as err:  # missing or broken: the cell that needs it will say so
                    log(f"preloading {name} failed: {err!r}")
        finally:
            # Put the streams back unless a cell has replaced them meanwhile.
            if sys.stdout is quiet[0]:
                sys.stdout = quiet[0].inner
            if sys.stderr is quiet[1]:
                sys.stderr = quiet[1].inner

    def on_sigint(self, signum, frame):
        # Interrupts are aimed at user code. One that lands while the runner itself runs (the cell
        # has just finished) is dropped rather than breaking its bookkeeping.
        if self.interruptible:
            self.interrupt_delivered = True
            raise KeyboardInterrupt

    def keep_interrupting(self, target):
        """Re-sends SIGINT until the interrupt has been raised in the cell or the cell has ended.

        A signal that arrives between Python's last check for signals and the start of a blocking
        system call (time.sleep's nanosleep) does not interrupt that call, so the cell would only
        see it when the call returns; repeating the signal closes that window.
        """
        while True:
            time.sleep(0.2)
            with self.state_lock:
                if self.running_exec != target or self.interrupt_delivered:
                    return
                signal.pthread_kill(self.main_ident, signal.SIGINT)

    def main_loop(self):
        while True:
            with self.exec_ready:
                while not self.exec_queue:
                    self.exec_ready.wait()
                req = self.exec_queue.popleft()
                self.running_exec = req["id"]
                # An interrupt that arrived while the cell still waited here applies now.
                self.interrupt_requested = req["id"] == self.interrupt_target
            # Tells the agent the cell has been taken: should the kernel die from now on, the
            # cell may have run; before, the agent hands it to the next kernel instead.
            WRITER.event(req["id"], "started")
            try:
                self.run_exec(req)
            except Exception as err:  # a bug: report it and keep serving
                WRITER.error(req["id"], "internal", f"kernel error: {err!r}")
            finally:
                with self.state_lock:
                    self.running_exec = None

    def run_exec(self, req):
        req_id = req["id"]
        sink = OutputSink(req_id, req["output_limit"])
        count = self.kernel.next_count()
        self.capture.attach(sink)
        self.figures.begin(req_id, count)
        value, error = None, None
        try:
            self.interruptible = True
            try:
                if self.interrupt_requested:
                    self.interrupt_delivered = True
                    raise KeyboardInterrupt
                self.figures.patch_pyplot()  # pyplot may have finished loading in the background
                value, error = self.kernel.run(req["code"])
                # A cell that imported pyplot itself gets the patched show from its next cell on;
                # figures it left open are emitted below either way.
                self.figures.patch_pyplot()
                self.figures.flush()
            finally:
                self.interruptible = False
        except KeyboardInterrupt:
            # The interrupt came before the cell's code started, or hit the figure flush after it.
            error = error or {"name": "KeyboardInterrupt", "value": "", "traceback": []}
        except Exception as err:
            traceback.print_exc()  # goes to the cell's stderr
            error = error or {"name": type(err).__name__, "value": str(err), "traceback": []}
        finally:
            self.figures.end()
            self.capture.detach()
        with self.state_lock:
            self.running_exec = None
        WRITER.ok(
            req_id,
            {
                "execution_count": count,
                "result": value or None,
                "error": error,
                "truncated": sink.truncated,
            },
        )

    def op_exec(self, req_id, frame):
        code = frame.get("code")
        if not isinstance(code, str):
            raise OpError("bad_request", "exec needs a string 'code'")
        limit = int_arg(frame, "output_limit", DEFAULT_OUTPUT_LIMIT)
        with self.exec_ready:
            self.exec_queue.append({"id": req_id, "code": code, "output_limit": limit})
            self.exec_ready.notify()

    def op_interrupt(self, req_id, frame):
        target = frame.get("target")
        with self.state_lock:
            self.interrupt_target = target
            if target is not None and target == self.running_exec:
                self.interrupt_requested = True
                self.interrupt_delivered = False
                # A real signal (not _thread.interrupt_main) so that blocking calls such as
                # time.sleep are woken with EINTR; the handler then raises KeyboardInterrupt.
                signal.pthread_kill(self.main_ident, signal.SIGINT)
                threading.Thread(
                    target=self.keep_interrupting, args=(target,), name="interrupt", daemon=True
                ).start()



# --------------------------------------------------------------------------------------------------
# Package index relay (PROTOCOL.md, "index_serve")
#
# The sandbox has no network, but its pip is configured (/etc/pip.conf in the image) to use a
# package index on loopback inside the container: this small HTTP server, run by the agent. It
# answers nothing itself: each request pip makes becomes an `index_request` event of the gateway's
# open `index_serve` call, and the gateway's answer (chunk frames with the same id) is streamed back
# to pip. The gateway decides everything (policy, wheels only, hashes, its cache); the agent only
# carries bytes. Installed packages go to PYTHONUSERBASE (a tmpfs of their own, outside the home).

# Where the relay listens (loopback inside the container; the image's pip.conf names this port).
INDEX_PORT = int(os.environ.get("SANDGATE_AGENT_INDEX_PORT") or 3141)
# Where pip installs packages for the sandbox user (`pip install --user`, set in pip.conf).
PACKAGES_BASE = os.environ.get("SANDGATE_AGENT_PACKAGES") or "/opt/packages"
# The longest path the relay forwards; project names and wheel file names are far shorter.
INDEX_MAX_PATH = 1024
# How long a pip request waits for the gateway's next frame before it gets 504.
INDEX_FRAME_TIMEOUT_S = 120.0
# Requests relayed at once (pip makes a handful); beyond, pip is answered 503 at once.
INDEX_MAX_PENDING = 16
# Notes the relay keeps for the pip wrapper (what the gateway refused and why).
INDEX_MAX_NOTES = 50
# How long a pip request waits for the gateway to open the relay after the agent asked for it
# (an `index_wanted` event on a running call); the gateway opens it in milliseconds.
INDEX_WANTED_WAIT_S = 10.0
# What pip hears when no call holds the relay open (a background job, or a gateway without it).
INDEX_NOT_SERVING = (
    "package installs work only inside a call (run_terminal_command, execute_code, "
    "install_packages), not in background jobs"
)
INDEX_PATH = re.compile(r"^/(simple/(?:[A-Za-z0-9._-]+/)?|files/[0-9a-f]{64}/[A-Za-z0-9._+!-]+)$")


def user_site():
    """The site directory pip installs the sandbox user's packages into (PEP 370 user scheme)."""
    version = "%d.%d" % sys.version_info[:2]
    return os.path.join(PACKAGES_BASE, "lib", f"python{version}", "site-packages")


def prepare_user_site():
    """Creates the user site directory before the kernel starts, so that Python puts it on sys.path
    at start-up (it is added only when it exists) and the next cell imports what pip installed."""
    if not os.path.isdir(PACKAGES_BASE):
        return
    try:
        CREDS.run_as_user(os.makedirs, user_site(), 0o755, True)
    except OSError as err:
        log(f"cannot create {user_site()}: {err}")


def register_pip_magic(shell):
    """`%pip` runs the image's `pip` command (the wrapper that also prints what the package index
    refused and why), not IPython's `python -m pip`, and makes the new packages importable in the
    next line. `!pip` reaches the same command through the shell."""

    def pip(line):
        shell.system("pip " + line)
        importlib.invalidate_caches()

    try:
        shell.register_magic_function(pip, "line", "pip")
    except Exception as err:  # IPython without this API: its own %pip stays
        log(f"%pip not replaced: {err!r}")


class IndexRelay:
    """The loopback package index: forwards pip's requests to the gateway's `index_serve` call."""

    def __init__(self):
        self.lock = threading.Lock()
        self.served = threading.Condition(self.lock)  # notified when a serve call opens
        self.serving = None  # request id of the open index_serve call
        # Returns the id of a running exec or command (whose gateway call can open the relay on
        # demand), or None; set by the agent.
        self.call_for_index = lambda: None
        self.pending = {}  # relay request id -> queue of chunk frames
        self.next_rid = 1
        self.notes = collections.deque(maxlen=INDEX_MAX_NOTES)  # (seq, text)
        self.note_seq = 0
        self.server = None

    def start(self):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        handler = type("IndexHandler", (IndexHandler, BaseHTTPRequestHandler), {})
        try:
            self.server = ThreadingHTTPServer(("127.0.0.1", INDEX_PORT), handler)
        except OSError as err:
            log(f"package index relay not started on 127.0.0.1:{INDEX_PORT}: {err}")
            return
        self.server.daemon_threads = True
        self.server.relay = self
        threading.Thread(target=self.server.serve_forever, name="index-relay", daemon=True).start()

    def port(self):
        return self.server.server_address[1] if self.server else None

    def serve(self, req_id):
        """A gateway call opens the relay; a newer call replaces an older one (answered at once)."""
        with self.lock:
            old, self.serving = self.serving, req_id
            self.served.notify_all()
        if old is not None:
            WRITER.ok(old, {"served": False, "replaced": True})

    def close(self, req_id):
        """Ends the open serve call `req_id` (the gateway's interrupt); False when not open."""
        with self.lock:
            if self.serving != req_id:
                return False
            self.serving = None
            pending = list(self.pending.values())
        for frames in pending:  # requests still waiting: the gateway will not answer them now
            frames.put({"closed": True})
        WRITER.ok(req_id, {"served": True, "replaced": False})
        return True

    def route(self, req_id, frame):
        """Takes a chunk frame of the serve call; True when it was one (even if now unwanted)."""
        with self.lock:
            if req_id is None or req_id != self.serving:
                return False
            frames = self.pending.get(frame.get("rid"))
        if frames is not None:
            try:
                frames.put(frame, timeout=INDEX_FRAME_TIMEOUT_S)
            except queue.Full:
                pass
        return True

    def add_note(self, text):
        with self.lock:
            self.note_seq += 1
            self.notes.append((self.note_seq, text[:2000]))

    def notes_after(self, seq):
        with self.lock:
            return self.note_seq, [text for n, text in self.notes if n > seq]

    def ask_for_serving(self):
        """Has the gateway open the relay on demand: it opens no `index_serve` beside a call until
        pip asks (a plain cell costs no extra op). The ask is an `index_wanted` event on a running
        exec or command, whose gateway call then opens the relay; True once it is open. Without a
        running call (pip in a background job between calls) there is nobody to ask."""
        with self.lock:
            if self.serving is not None:
                return True
        call = self.call_for_index()
        if call is None:
            return False
        WRITER.event(call, "index_wanted")
        with self.lock:
            return self.served.wait_for(lambda: self.serving is not None, INDEX_WANTED_WAIT_S)

    def relay(self, path):
        """Sends one request to the gateway; returns (rid, queue of its answer frames) or an error
        (status, text) when it cannot be sent."""
        if not self.ask_for_serving():
            return None, (503, INDEX_NOT_SERVING)
        with self.lock:
            if self.serving is None:
                return None, (503, INDEX_NOT_SERVING)
            if len(self.pending) >= INDEX_MAX_PENDING:
                return None, (503, "too many package index requests at once")
            rid = self.next_rid
            self.next_rid += 1
            frames = queue.Queue(maxsize=WRITE_QUEUE_CHUNKS)
            self.pending[rid] = frames
            serving = self.serving
        WRITER.event(serving, "index_request", rid=rid, path=path)
        return rid, frames

    def done(self, rid):
        with self.lock:
            self.pending.pop(rid, None)


class IndexHandler:
    """pip's side of the relay: GET only, known paths only, the answer streamed as it arrives.

    The methods of an http.server.BaseHTTPRequestHandler, which IndexRelay.start puts under it
    (imported there, in the agent only)."""

    server_version = "sandgate-index"
    # HTTP/1.0: the answer's end is the connection's end, so a streamed body needs no length.
    protocol_version = "HTTP/1.0"
    # A client that connects and says nothing (or reads nothing) does not keep a thread of the
    # agent for ever.
    timeout = 60

    def log_message(self, format, *args):  # noqa: A002  (BaseHTTPRequestHandler's signature)
        pass  # pip's requests are not the container log's business

    def do_GET(self):  # noqa: N802  (BaseHTTPRequestHandler's naming)
        relay = self.server.relay
        url = urllib.parse.urlsplit(self.path)
        if url.path == "/_sandgate/notes":
            after = urllib.parse.parse_qs(url.query).get("after", ["0"])[0]
            seq, notes = relay.notes_after(int(after) if after.isdigit() else 0)
            self.answer(200, json.dumps({"seq": seq, "notes": notes}), "application/json")
            return
        if len(url.path) > INDEX_MAX_PATH or not INDEX_PATH.match(url.path):
            self.answer(404, "not a package index path")
            return
        rid, frames = relay.relay(url.path)
        if rid is None:
            status, text = frames
            relay.add_note(text)
            self.answer(status, text)
            return
        try:
            self.stream(relay, frames)
        except (BrokenPipeError, ConnectionResetError):
            pass  # pip went away; the rest of the answer is dropped
        finally:
            relay.done(rid)

    def stream(self, relay, frames):
        started = False
        while True:
            try:
                frame = frames.get(timeout=INDEX_FRAME_TIMEOUT_S)
            except queue.Empty:
                frame = {"closed": True}
            if frame.get("closed"):
                if not started:
                    self.answer(504, "the gateway did not answer this package index request")
                return
            if not started:
                started = True
                note = frame.get("note")
                if isinstance(note, str) and note:
                    relay.add_note(note)
                status = frame.get("status")
                self.send_response(status if isinstance(status, int) and 100 <= status < 600 else 502)
                self.send_header("Content-Type", str(frame.get("content_type") or "text/plain"))
                length = frame.get("length")
                if isinstance(length, int) and length >= 0:
                    self.send_header("Content-Length", str(length))
                self.end_headers()
            data = frame.get("data") or ""
            try:
                raw = base64.b64decode(data, validate=True) if data else b""
            except (binascii.Error, TypeError, ValueError):
                return  # a broken frame ends the answer; pip sees a short body and fails
            self.wfile.write(raw)
            if frame.get("last", True):
                return

    def answer(self, status, text, content_type="text/plain; charset=utf-8"):
        body = text.encode("utf-8")
        # The reason phrase carries the first line too (pip shows it for a failed download); the
        # status line is latin-1, so anything else becomes "?".
        reason = text.splitlines()[0][:200].encode("ascii", "replace").decode() if text else None
        self.send_response(status, reason if status >= 400 else None)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


# --------------------------------------------------------------------------------------------------
# The agent (root): the kernel's supervisor, commands, jobs, files


class KernelProcess:
    """One incarnation of the kernel: the uid-1000 process and its two pipes to the agent."""

    def __init__(self, agent):
        to_kernel_r, to_kernel_w = os.pipe()
        from_kernel_r, from_kernel_w = os.pipe()
        self.oom_before = oom_kills()
        self.pids_before = pids_refusals()
        try:
            self.proc = subprocess.Popen(
                KERNEL_ARGV,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(to_kernel_r, from_kernel_w),
                env=user_env({ENV_KERNEL_FDS: f"{to_kernel_r},{from_kernel_w}"}),
                cwd="/",
                start_new_session=True,  # signals aimed at the agent's group never reach it
                **CREDS.popen_args(),
            )
        finally:
            os.close(to_kernel_r)
            os.close(from_kernel_w)
        self.pid = self.proc.pid
        self.ready = threading.Event()
        # Set once every frame the kernel wrote has been read (its end of the pipe closed).
        self.read_all = threading.Event()
        self.info = None
        self.outbox = queue.Queue()
        self.in_fd = to_kernel_w
        self.out_fd = from_kernel_r
        # Set once the agent has made this kernel the current one (or given it up). Its frames
        # and its exit are handled only from then on: before, the kernel's ready frame (or its
        # exit) would be taken for a replaced kernel's and dropped, and the sandbox would never
        # say ready (or never replace a kernel that died at once).
        self.decided = threading.Event()
        started = set()
        try:
            for target, name in (
                (self._send_loop, "kernel-send"),
                (lambda: self._read_loop(agent), "kernel-read"),
                (lambda: self._wait(agent), "kernel-wait"),
            ):
                threading.Thread(target=target, name=name, daemon=True).start()
                started.add(name)
        except RuntimeError:
            # At the process limit a thread cannot start either: this kernel is given up (its
            # threads that did start end with it; it was never made the current kernel, so its
            # exit replaces nothing).
            self.kill()
            self.decided.set()
            if "kernel-send" not in started:
                os.close(self.in_fd)
            if "kernel-read" not in started:
                os.close(self.out_fd)
            if "kernel-wait" not in started:
                self.proc.wait()
            raise

    def send(self, obj):
        # Queued for a thread of its own: a kernel that stops reading (SIGSTOP from user code) must
        # not block the agent's reader.
        self.outbox.put((json.dumps(obj, separators=(",", ":")) + "\n").encode())

    def _send_loop(self):
        while True:
            line = self.outbox.get()
            if line is None:
                break
            try:
                view = memoryview(line)
                while view:
                    view = view[os.write(self.in_fd, view) :]
            except OSError:
                break
        os.close(self.in_fd)

    def _wait(self, agent):
        returncode = self.proc.wait()
        self.decided.wait()
        agent.on_kernel_exit(self, returncode)

    def _read_loop(self, agent):
        self.decided.wait()
        buffer = bytearray()
        discarding = False
        while True:
            try:
                data = os.read(self.out_fd, 1 << 20)
            except InterruptedError:
                continue
            except OSError:
                data = b""
            if not data:
                break
            buffer += data
            while True:
                newline = buffer.find(b"\n")
                if newline < 0:
                    if len(buffer) > MAX_FRAME_BYTES:
                        buffer.clear()
                        discarding = True
                        agent.on_kernel_junk(self, "a frame longer than the limit")
                    break
                line = bytes(buffer[:newline])
                del buffer[: newline + 1]
                if discarding:
                    discarding = False
                    continue
                agent.on_kernel_line(self, line)
        os.close(self.out_fd)
        self.read_all.set()

    def kill(self):
        try:
            self.proc.kill()
        except OSError:
            pass
        self.outbox.put(None)


class Run:
    """The exec the kernel is running, with what the agent has relayed of it so far."""

    def __init__(self, req):
        self.id = req["id"]
        self.code = req["code"]
        self.limit = req["output_limit"]
        self.output_bytes = 0
        self.display_bytes = 0
        self.truncated = False
        self.interrupted = False
        self.started = False  # the kernel has taken the cell (it may have run)
        self.junk = 0
        self.req = req


class Agent(FrameServer):
    # Ops that run acting as the sandbox user on the reader thread (path checks); their workers
    # switch too.
    USER_OPS = frozenset({"write_file", "read_file", "list_dir"})

    def __init__(self, proto_in):
        super().__init__(proto_in)
        self.state_lock = threading.Lock()
        self.kernel = None  # KernelProcess
        self.exec_queue = collections.deque()  # exec requests not yet sent to the kernel
        self.running = None  # Run sent to the kernel and not yet answered
        self.lost_reason = None  # why the kernel died while idle; told to the next exec
        # Why no kernel is ready to take cells, while a fresh one cannot start (told to a cell
        # that is given up while it waits); None when there is no such trouble.
        self.kernel_trouble = None
        self.next_count = 1
        self.ready_sent = False
        self.stopping = False
        self.commands = {}  # request id -> process group id of a running command
        self.jobs = collections.OrderedDict()  # job id -> dict (the protocol's job object)
        self.job_procs = {}  # job id -> Popen of a running job
        self.job_seq = 0
        self.uploads = {}  # request id -> queue of chunk frames of a running write_file
        self.upload_tmp = {}  # request id -> temporary file of a running write_file
        self.index = IndexRelay()
        self.index.call_for_index = self.call_for_index

    def call_for_index(self):
        """A running exec or command, whose gateway call can open the package index relay when pip
        asks for it (PROTOCOL.md, `index_wanted`); None when none runs."""
        with self.state_lock:
            if self.running is not None:
                return self.running.id
            return next(iter(self.commands), None)

    def start(self):
        prepare_user_site()
        self.index.start()
        self.start_kernel(lambda kp: setattr(self, "kernel", kp))

    def start_kernel(self, publish):
        """Starts a kernel and hands it to `publish` (under SPAWN_LOCK, so that a sweep sees it as
        a root from the start). While the sandbox is at its process limit (a fork bomb, say) the
        start fails; it is tried again until it succeeds, so that the sandbox has a kernel again
        as soon as processes are free. Returns the kernel, or None if the agent stops meanwhile."""
        delay, failures = 0.05, 0
        while not self.stopping:
            with SPAWN_LOCK:
                try:
                    kp = KernelProcess(self)
                except (OSError, RuntimeError) as err:
                    failure = err
                    with self.state_lock:
                        self.kernel_trouble = "a new kernel cannot start: " + (
                            AT_PROCESS_LIMIT
                            if isinstance(err, (BlockingIOError, RuntimeError))
                            else str(err)
                        )
                else:
                    publish(kp)
                    kp.decided.set()
                    if failures:
                        log(f"kernel {kp.pid} started after {failures} failed attempts")
                    return kp
            if failures == 0:
                log(f"cannot start a kernel yet ({failure!r}); trying again until it starts")
            failures += 1
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
        return None

    # ----- frames from the gateway

    def dispatch_op(self, op, handler, req_id, frame):
        if op in self.USER_OPS:
            CREDS.run_as_user(handler, req_id, frame)
        else:
            handler(req_id, frame)

    # ----- the kernel

    def on_kernel_line(self, kp, line):
        """A frame from the kernel: relayed only if it belongs to the cell it is running."""
        try:
            frame = json.loads(line)
        except ValueError:
            frame = None
        if not isinstance(frame, dict):
            self.on_kernel_junk(kp, "a line that is not a JSON object")
            return
        if frame.get("event") == "ready" and "id" not in frame:
            self.on_kernel_ready(kp, frame)
            return
        with self.state_lock:
            run = self.running
            ours = kp is self.kernel and run is not None and frame.get("id") == run.id
        if not ours:
            # Answers to the agent's own interrupts, or frames forged by user code in the kernel
            # for requests it does not run: never relayed.
            return
        event = frame.get("event")
        if event == "started":
            with self.state_lock:
                run.started = True
        elif event is not None:
            self.relay_event(run, event, frame)
        elif frame.get("ok") is True and isinstance(frame.get("result"), dict):
            self.finish_exec(run, frame["result"])
        else:
            error = frame.get("error") if isinstance(frame.get("error"), dict) else {}
            message = str(error.get("message", "the kernel failed the cell"))[:4096]
            self.finish_exec(run, None, error=message)

    def on_kernel_junk(self, kp, what):
        with self.state_lock:
            run = self.running if kp is self.kernel else None
            if run is not None:
                run.junk += 1
                run.truncated = True

    def relay_event(self, run, event, frame):
        if event in ("stdout", "stderr"):
            data = frame.get("data")
            if not isinstance(data, str):
                return
            size = len(data.encode("utf-8", "replace"))
            with self.state_lock:
                if run.output_bytes + size > run.limit + MARKER_SLACK:
                    run.truncated = True
                    return
                run.output_bytes += size
            WRITER.event(run.id, event, data=data)
        elif event == "display":
            data = frame.get("data")
            path = frame.get("path")
            if not isinstance(data, dict):
                return
            size = len(json.dumps(data))
            with self.state_lock:
                if run.display_bytes + size > DISPLAY_LIMIT * 4 // 3 + MARKER_SLACK:
                    run.truncated = True
                    return
                run.display_bytes += size
            fields = {"data": data}
            if isinstance(path, str):
                fields["path"] = path
            WRITER.event(run.id, "display", **fields)

    def finish_exec(self, run, result, error=None):
        with self.state_lock:
            if self.running is not run:
                return
            self.running = None
            lost, self.lost_reason = self.lost_reason, None
            kernel_pid = self.kernel.pid if self.kernel else None
        count = result.get("execution_count") if result else None
        if isinstance(count, int):
            self.next_count = count + 1
        if run.interrupted:
            # Timed out or cancelled: whatever the cell started goes too (the kernel stays).
            sweep(lambda: self.keep_roots(kernel=False), keep_pids=[kernel_pid])
        else:
            sweep(lambda: self.keep_roots(kernel=True))
        if result is None:
            WRITER.error(run.id, "internal", f"the kernel failed the cell: {error}")
        else:
            cell_error = result.get("error")
            value = result.get("result")
            WRITER.ok(
                run.id,
                {
                    "execution_count": count if isinstance(count, int) else None,
                    "result": value if isinstance(value, dict) and value else None,
                    "error": cell_error if isinstance(cell_error, dict) else None,
                    "truncated": bool(result.get("truncated")) or run.truncated,
                    "state_lost": lost is not None,
                    "state_lost_reason": lost,
                },
            )
        self.dispatch()

    def dispatch(self):
        """Sends the next queued exec to the kernel when it is ready and idle."""
        with self.state_lock:
            kp = self.kernel
            if self.running is not None or not self.exec_queue or kp is None:
                return
            if not kp.ready.is_set() or leader_exited(kp.pid):
                return  # a dead kernel's successor takes the cell when it is ready
            run = self.running = Run(self.exec_queue.popleft())
            kp.send({"id": run.id, "op": "exec", "code": run.code, "output_limit": run.limit})

    def on_kernel_ready(self, kp, frame):
        with self.state_lock:
            if kp is not self.kernel or kp.ready.is_set():
                return
            kp.info = frame
            self.kernel_trouble = None
            count = frame.get("next_count")
            if isinstance(count, int):
                self.next_count = count
            kp.ready.set()
            first = not self.ready_sent
            self.ready_sent = True
        if first:
            WRITER.send(
                {
                    "event": "ready",
                    "protocol": PROTOCOL_VERSION,
                    "pid": os.getpid(),
                    "kernel_pid": kp.pid,
                    "python": platform.python_version(),
                    "ipython": bool(frame.get("ipython")),
                    "preloaded": [p for p in frame.get("preloaded", []) if isinstance(p, str)],
                    "isolated": CREDS.root,
                    "index_port": self.index.port(),
                }
            )
        self.dispatch()

    def on_kernel_exit(self, kp, returncode):
        with self.state_lock:
            current = kp is self.kernel and not self.stopping
            was_ready = kp.ready.is_set()
        if not current:
            return  # replaced on purpose (restart)
        # Frames the kernel wrote before it died (a cell's "started" above all) count: without
        # them a cell that had started would be taken for one that had not, and run again.
        kp.read_all.wait(READ_AFTER_EXIT_S)
        reason = describe_exit(returncode, kp.oom_before, kp.pids_before)
        log(f"kernel {kp.pid} ended: {reason}")
        if not was_ready:
            with self.state_lock:
                self.kernel_trouble = f"a new kernel could not start: {reason}"
            time.sleep(1.0)  # a kernel that cannot start must not spin
        self.replace_kernel(kp, reason, report_next=True)

    def replace_kernel(self, old, reason, report_next):
        """Ends the kernel `old` (and everything it started), answers its running cell with
        `state_lost`, and starts a fresh kernel. Returns the new one (None if `old` was already
        replaced)."""
        with self.state_lock:
            if old is not self.kernel:
                return None
            run, self.running = self.running, None
            self.kernel = None
        old.kill()
        sweep(lambda: self.keep_roots(kernel=False))
        if run is not None and not run.started and not run.interrupted:
            # The kernel died before it took the cell: the next kernel runs it, and it is told
            # that the state was lost.
            with self.state_lock:
                self.exec_queue.appendleft(run.req)
            run = None
        if run is not None:
            WRITER.ok(
                run.id,
                {
                    "execution_count": None,
                    "result": None,
                    "error": {
                        "name": "KernelDied",
                        "value": f"{reason}; all variables are lost (files in {HOME} are kept)",
                        "traceback": [],
                    },
                    "truncated": run.truncated,
                    "state_lost": True,
                    "state_lost_reason": reason,
                },
            )

        def publish(new):
            with self.state_lock:
                if report_next and run is None:
                    self.lost_reason = reason
                self.kernel = new

        return self.start_kernel(publish)

    def keep_roots(self, kernel):
        """The roots of the process trees a sweep must spare: running commands and jobs, and the
        kernel's whole tree when `kernel`."""
        with self.state_lock:
            roots = list(self.commands.values())
            roots += [p.pid for p in self.job_procs.values()]
            if kernel and self.kernel is not None:
                roots.append(self.kernel.pid)
        return roots

    # ----- ops

    def op_ping(self, req_id, frame):
        with self.state_lock:
            busy = self.running is not None
            kernel_pid = self.kernel.pid if self.kernel else None
        WRITER.ok(req_id, {"pong": True, "pid": os.getpid(), "busy": busy, "kernel_pid": kernel_pid})

    def op_exec(self, req_id, frame):
        code = frame.get("code")
        if not isinstance(code, str):
            raise OpError("bad_request", "exec needs a string 'code'")
        limit = int_arg(frame, "output_limit", DEFAULT_OUTPUT_LIMIT)
        with self.state_lock:
            self.exec_queue.append({"id": req_id, "code": code, "output_limit": limit})
        self.dispatch()

    def op_interrupt(self, req_id, frame):
        target = frame.get("target")
        if isinstance(target, (dict, list)):
            raise OpError("bad_request", "target must be a request id")
        interrupted = False
        queued = None
        with self.state_lock:
            trouble = self.kernel_trouble
            run = self.running
            if target is not None and run is not None and target == run.id:
                run.interrupted = True
                self.kernel.send({"id": req_id, "op": "interrupt", "target": target})
                interrupted = True
            elif target in self.commands:
                kill_group(self.commands[target])
                interrupted = True
            elif target is not None and self.index.close(target):
                interrupted = True
            else:
                for req in self.exec_queue:
                    if req["id"] == target:
                        queued = req
                        self.exec_queue.remove(req)
                        interrupted = True
                        break
        if queued is not None:
            # Answered before the interrupt's own result, so the gateway sees the cell settled.
            # It never ran, so it did not take an execution count; the number reported is the one
            # the next cell will get.
            WRITER.ok(
                queued["id"],
                {
                    "execution_count": self.next_count,
                    "result": None,
                    "error": {
                        "name": "KeyboardInterrupt",
                        "value": "interrupted before it started"
                        + (f" ({trouble})" if trouble else ""),
                        "traceback": [],
                    },
                    "truncated": False,
                    "state_lost": False,
                    "state_lost_reason": None,
                },
            )
        WRITER.ok(req_id, {"interrupted": interrupted})

    def op_restart(self, req_id, frame):
        reason = frame.get("reason")
        if not isinstance(reason, str) or not reason:
            reason = "the kernel was restarted at the gateway's request"
        self.spawn("restart", self.run_restart, req_id, reason[:1000])

    def run_restart(self, req_id, reason):
        with self.state_lock:
            old = self.kernel
        new = self.replace_kernel(old, reason, report_next=False) if old is not None else None
        if new is None:
            with self.state_lock:
                new = self.kernel
        if new is None or not new.ready.wait(KERNEL_READY_S):
            raise OpError("internal", f"the new kernel did not become ready in {KERNEL_READY_S:.0f}s")
        WRITER.ok(req_id, {"restarted": True, "kernel_pid": new.pid})

    def op_command(self, req_id, frame):
        command = frame.get("command")
        if not isinstance(command, str):
            raise OpError("bad_request", "command needs a string 'command'")
        timeout_ms = frame.get("timeout_ms")
        if timeout_ms is not None and (not isinstance(timeout_ms, (int, float)) or timeout_ms < 0):
            raise OpError("bad_request", "timeout_ms must be a non-negative number")
        limit = int_arg(frame, "output_limit", DEFAULT_OUTPUT_LIMIT)
        # Checked as the user; the threads that start processes must stay root (a thread inherits
        # the credentials of the one that creates it).
        cwd = CREDS.run_as_user(checked_cwd, frame.get("cwd"))
        if frame.get("background"):
            self.start_job(req_id, command, cwd)
            return
        self.spawn("command", self.run_command, req_id, command, timeout_ms, limit, cwd)

    def start_job(self, req_id, command, cwd):
        with self.state_lock:
            if len(self.job_procs) >= MAX_JOBS:
                raise OpError(
                    "limit",
                    f"{MAX_JOBS} background jobs are running already; kill one first "
                    "(kill_job) or wait for one to end",
                )
            self.job_seq += 1
            job_id = f"job-{self.job_seq}"
        log_path = f"{JOBS_DIR}/{job_id}.log"
        # The job creates its log itself, as the sandbox user, so the agent never writes into a
        # directory user code controls.
        script = 'mkdir -p -- "$3" && cd -- "$1" || exit 126; exec bash -lc "$2" >"$4" 2>&1'
        with SPAWN_LOCK:
            proc = start_user_shell(
                [script, "sandgate-job", cwd, command, JOBS_DIR, log_path], subprocess.DEVNULL
            )
            job = {
                "id": job_id,
                "pid": proc.pid,
                "command": command,
                "log": log_path,
                "started": time.time(),
                "running": True,
                "exit_code": None,
                "signal": None,
            }
            with self.state_lock:
                self.jobs[job_id] = job
                self.job_procs[job_id] = proc
            while len(self.jobs) > 4 * MAX_JOBS:  # forget the oldest finished ones
                oldest = next((j for j in self.jobs if j not in self.job_procs), None)
                if oldest is None:
                    break
                del self.jobs[oldest]
        threading.Thread(target=self.wait_job, args=(job_id, proc), daemon=True).start()
        WRITER.ok(req_id, {"job": dict(job)})

    def wait_job(self, job_id, proc):
        while not leader_exited(proc.pid):
            time.sleep(0.1)
        kill_group(proc.pid)  # the group goes with its leader, still unreaped (see leader_exited)
        rc = proc.wait()
        with self.state_lock:
            self.job_procs.pop(job_id, None)
            job = self.jobs.get(job_id)
            if job is not None:
                job.update(
                    running=False,
                    exit_code=rc if rc >= 0 else None,
                    signal=-rc if rc < 0 else None,
                )

    def op_jobs(self, req_id, frame):
        with self.state_lock:
            jobs = [dict(job) for job in self.jobs.values()]
        WRITER.ok(req_id, {"jobs": jobs})

    def op_kill_job(self, req_id, frame):
        job_id = frame.get("job")
        with self.state_lock:
            job = self.jobs.get(job_id) if isinstance(job_id, str) else None
            proc = self.job_procs.get(job_id) if job is not None else None
        if job is None:
            raise OpError("not_found", f"no background job {job_id!r}; list them with jobs")
        if proc is not None:
            kill_group(proc.pid)
            procs = read_processes()
            for pid in belonging(procs, [proc.pid]):
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        try:
            self.spawn("kill_job", self.finish_kill_job, req_id, job_id, proc)
        except OpError:
            # The kill is done; its end is recorded when processes are free again.
            with self.state_lock:
                job = dict(self.jobs.get(job_id, {}))
            WRITER.ok(req_id, {"killed": proc is not None, "job": job})

    def finish_kill_job(self, req_id, job_id, proc):
        deadline = time.monotonic() + SWEEP_S
        while True:
            with self.state_lock:
                job = dict(self.jobs.get(job_id, {}))
            if not job.get("running") or time.monotonic() >= deadline:
                break
            time.sleep(0.01)  # wait_job records the end
        WRITER.ok(req_id, {"killed": proc is not None, "job": job})

    def run_command(self, req_id, command, timeout_ms, limit, cwd):
        sink = OutputSink(req_id, limit)
        script = 'cd -- "$1" || exit 126; exec bash -lc "$2"'
        with SPAWN_LOCK:
            proc = start_user_shell([script, "sandgate", cwd, command], subprocess.PIPE)
            pgid = proc.pid  # start_new_session: the child leads its own session and group
            with self.state_lock:
                self.commands[req_id] = pgid
        timed_out = False
        try:
            timed_out = self.pump_command(proc, pgid, timeout_ms, sink)
        finally:
            with self.state_lock:
                self.commands.pop(req_id, None)
            # Killed while the leader is still unreaped (see leader_exited), so the group id cannot
            # have been reused yet; then everything that left the group (setsid, double fork).
            kill_group(pgid)
            sweep(lambda: self.keep_roots(kernel=True))
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        sink.finish()
        rc = proc.returncode
        WRITER.ok(
            req_id,
            {
                "exit_code": rc if rc >= 0 else None,
                "signal": -rc if rc < 0 else None,
                "timed_out": timed_out,
                "truncated": sink.truncated,
            },
        )

    def pump_command(self, proc, pgid, timeout_ms, sink):
        """Relays a command's output until it has exited; kills its group at the timeout. Returns
        whether it timed out."""
        timed_out = False
        pidfd = None
        streams = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr"}
        for fd in streams:
            os.set_blocking(fd, False)
        try:
            pidfd = os.pidfd_open(proc.pid)  # becomes readable when the process exits
        except (AttributeError, OSError):
            pass  # old kernel or gVisor without pidfd: poll below instead
        try:
            deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
            exited_at = None
            while True:
                now = time.monotonic()
                if exited_at is None:
                    if leader_exited(proc.pid):
                        exited_at = now
                        # Background children (`sleep 100 &`) must not outlive the command, nor
                        # keep us waiting for EOF on pipes they hold open.
                        kill_group(pgid)
                    elif deadline is not None and now >= deadline:
                        timed_out = True
                        kill_group(pgid)
                        deadline = None  # the exit is noticed on a following turn
                if exited_at is not None:
                    # Collect what is already in the pipes, briefly: a process that left the group
                    # (setsid) could hold them open until the sweep.
                    left = exited_at + COMMAND_DRAIN_S - now
                    if not streams or left <= 0:
                        break
                    wait = left
                else:
                    # With a pidfd, select wakes at the exit; without one, poll for it.
                    wait = 0.05 if pidfd is None else None
                    if deadline is not None:
                        until_deadline = max(0.0, deadline - now)
                        wait = until_deadline if wait is None else min(wait, until_deadline)
                fds = list(streams)
                if pidfd is not None and exited_at is None:
                    fds.append(pidfd)
                try:
                    readable, _, _ = select.select(fds, [], [], wait)
                except InterruptedError:
                    continue
                for fd in readable:
                    if fd == pidfd:
                        continue  # the exit is handled at the top of the next turn
                    try:
                        data = os.read(fd, 1 << 20)
                    except BlockingIOError:
                        continue
                    if data:
                        sink.feed(streams[fd], data)
                    else:
                        del streams[fd]
        finally:
            if pidfd is not None:
                os.close(pidfd)
        return timed_out

    def stop(self):
        """Ends the kernel, every command and job and whatever they started (agent exit)."""
        with self.state_lock:
            self.stopping = True
            kp = self.kernel
            groups = list(self.commands.values()) + [p.pid for p in self.job_procs.values()]
        if kp is not None:
            kp.kill()
        for pgid in groups:
            kill_group(pgid)
        sweep(list)

    # ----- files (as the sandbox user)

    def op_write_file(self, req_id, frame):
        target = resolve_path(frame.get("path"), default=None)
        size = frame.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise OpError("bad_request", "write_file needs a non-negative integer 'size'")
        overwrite = bool(frame.get("overwrite", False))
        if target == HOME or os.path.isdir(target):
            raise OpError("is_directory", f"{target} is a directory")
        if os.path.lexists(target) and not overwrite:
            raise OpError("exists", f"{target} exists")
        chunks = queue.Queue(maxsize=WRITE_QUEUE_CHUNKS)
        with self.state_lock:
            self.uploads[req_id] = chunks
        self.spawn("write_file", self.run_write, req_id, target, size, overwrite, chunks, as_user=True)

    def op_index_serve(self, req_id, frame):
        self.index.serve(req_id)

    def route_chunk(self, req_id, frame):
        if self.index.route(req_id, frame):
            return
        with self.state_lock:
            chunks = self.uploads.get(req_id)
        # Chunks of an upload that was refused, has failed or was cut off by a restart are dropped
        # silently: that request already has (or will never get) its one final frame.
        while chunks is not None:
            try:
                chunks.put(frame, timeout=1.0)
                return
            except queue.Full:
                # The writer may have failed meanwhile; then nobody will empty this queue.
                with self.state_lock:
                    if self.uploads.get(req_id) is not chunks:
                        return

    def run_write(self, req_id, target, size, overwrite, chunks):
        tmp_path = None
        try:
            parent = os.path.dirname(target)
            try:
                os.makedirs(parent, exist_ok=True)
            except FileExistsError:
                raise OpError("not_a_directory", f"{parent} exists and is not a directory")
            except OSError as err:
                raise io_error(err, parent)
            # makedirs may have walked through a symlink created meanwhile; check again.
            if resolve_path(parent) != parent:
                raise OpError("outside_home", f"{parent} is outside {HOME}")
            digest = hashlib.sha256()
            written = 0
            try:
                fd, tmp_path = tempfile.mkstemp(
                    dir=parent, prefix=f".{os.path.basename(target)}.", suffix=".sandgate-tmp"
                )
            except OSError as err:
                raise io_error(err, parent)
            with self.state_lock:
                self.upload_tmp[req_id] = tmp_path
            with os.fdopen(fd, "wb") as f:
                last = size == 0  # an empty file needs no chunk; a stray empty one is dropped
                while not last:
                    try:
                        chunk = chunks.get(timeout=WRITE_IDLE_TIMEOUT_S)
                    except queue.Empty:
                        raise OpError(
                            "io", f"upload stalled: no chunk for {WRITE_IDLE_TIMEOUT_S:.0f}s"
                        )
                    data = chunk.get("data", "")
                    try:
                        raw = base64.b64decode(data, validate=True) if data else b""
                    except (binascii.Error, TypeError, ValueError):
                        raise OpError("bad_request", "chunk data is not valid base64")
                    written += len(raw)
                    if written > size:
                        raise OpError("bad_request", f"more data than the announced {size} bytes")
                    digest.update(raw)
                    try:
                        f.write(raw)
                    except OSError as err:
                        raise io_error(err, target)
                    last = bool(chunk.get("last", False))
                if written != size:
                    raise OpError("bad_request", f"got {written} bytes, {size} announced")
                try:
                    f.flush()
                    os.fchmod(f.fileno(), 0o666 & ~current_umask())
                except OSError as err:
                    raise io_error(err, target)
            try:
                if overwrite:
                    os.replace(tmp_path, target)
                else:
                    # link() fails if the target appeared meanwhile: no silent overwrite.
                    os.link(tmp_path, target)
                    os.unlink(tmp_path)
            except IsADirectoryError:
                raise OpError("is_directory", f"{target} is a directory")
            except OSError as err:
                raise io_error(err, target)
            tmp_path = None
            WRITER.ok(req_id, {"path": target, "size": written, "sha256": digest.hexdigest()})
        finally:
            with self.state_lock:
                self.uploads.pop(req_id, None)
                self.upload_tmp.pop(req_id, None)
            # Unblock a reader thread that may be waiting to queue one more chunk.
            while True:
                try:
                    chunks.get_nowait()
                except queue.Empty:
                    break
            if tmp_path is not None:
                try:
                    os.unlink(tmp_path)
                except OSError:
                    pass

    def op_read_file(self, req_id, frame):
        target = resolve_path(frame.get("path"), default=None)
        max_bytes = frame.get("max_bytes")
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 0):
            raise OpError("bad_request", "max_bytes must be a non-negative integer")
        self.spawn("read_file", self.run_read, req_id, target, max_bytes, as_user=True)

    def run_read(self, req_id, target, max_bytes):
        try:
            st = os.stat(target)
        except OSError as err:
            raise io_error(err, target)
        if stat.S_ISDIR(st.st_mode):
            raise OpError("is_directory", f"{target} is a directory")
        if not stat.S_ISREG(st.st_mode):
            # A FIFO or device could block forever or never end.
            raise OpError("io", f"{target} is not a regular file")
        if max_bytes is not None and st.st_size > max_bytes:
            raise OpError(
                "too_large", f"{target} is {st.st_size} bytes, larger than the limit of {max_bytes}"
            )
        digest = hashlib.sha256()
        size = 0
        try:
            with open(target, "rb") as f:
                while True:
                    data = f.read(CHUNK_SIZE)
                    if not data:
                        break
                    size += len(data)
                    if max_bytes is not None and size > max_bytes:
                        # The file grew while being read; what was sent stays short of the limit.
                        raise OpError(
                            "too_large", f"{target} grew beyond the limit of {max_bytes} bytes"
                        )
                    digest.update(data)
                    WRITER.event(req_id, "chunk", data=base64.b64encode(data).decode("ascii"))
        except OSError as err:
            raise io_error(err, target)
        WRITER.ok(
            req_id,
            {"path": target, "size": size, "sha256": digest.hexdigest(), "space": space()},
        )

    def op_list_dir(self, req_id, frame):
        target = resolve_path(frame.get("path"))
        self.spawn("list_dir", self.run_list_dir, req_id, target, as_user=True)

    def run_list_dir(self, req_id, target):
        entries = []
        try:
            with os.scandir(target) as it:
                for entry in it:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue  # vanished meanwhile
                    if stat.S_ISLNK(st.st_mode):
                        kind = "symlink"
                    elif stat.S_ISDIR(st.st_mode):
                        kind = "dir"
                    elif stat.S_ISREG(st.st_mode):
                        kind = "file"
                    else:
                        kind = "other"
                    entries.append(
                        {
                            "name": entry.name,
                            "type": kind,
                            "size": st.st_size,
                            "modified": st.st_mtime,
                        }
                    )
        except OSError as err:
            raise io_error(err, target)
        entries.sort(key=lambda e: e["name"])
        WRITER.ok(req_id, {"path": target, "entries": entries, "space": space()})



# The name the agent's own code objects carry ("<string>" when run with -c).
AGENT_FILE = CellRunner.on_sigint.__code__.co_filename


def start_user_shell(args, output):
    """Starts `bash -c <args…>` as the sandbox user in a session of its own, stdin from /dev/null,
    stdout and stderr to `output` (PIPE or DEVNULL), with the user's environment. (cwd is changed
    by the script: the agent, root without DAC_OVERRIDE, cannot enter the user's home itself.)"""
    try:
        return subprocess.Popen(
            ["bash", "-c", *args],
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=output,
            start_new_session=True,
            close_fds=True,
            env=user_env(),
            **CREDS.popen_args(),
        )
    except OSError as err:
        raise OpError("io", f"cannot start bash: {err}")


def checked_cwd(path):
    cwd = resolve_path(path)
    if not os.path.exists(cwd):
        raise OpError("not_found", f"{cwd} does not exist")
    if not os.path.isdir(cwd):
        raise OpError("not_a_directory", f"{cwd} is not a directory")
    return cwd


def int_arg(frame, name, default):
    value = frame.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise OpError("bad_request", f"{name} must be a non-negative integer")
    return value


def current_umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def space():
    """Bytes used and left in the home directory's file system (its quota)."""
    try:
        st = os.statvfs(HOME)
    except OSError:
        return None
    return {
        "total": st.f_blocks * st.f_frsize,
        "used": (st.f_blocks - st.f_bfree) * st.f_frsize,
        "free": st.f_bavail * st.f_frsize,
    }


AGENT = None  # the Agent, in the agent role


def shutdown(code):
    """Leaves no user process behind (agent role), then exits at once (the main thread may be
    busy)."""
    if AGENT is not None:
        try:
            AGENT.stop()
        except Exception:
            pass
    os._exit(code)


def take_protocol_fds():
    """Returns (input, output, log) descriptors, private to the agent: duplicates of the
    container's stdin/stdout/stderr. fd 0, 1 and 2 then point at /dev/null."""
    fds = tuple(os.dup(fd) for fd in (0, 1, 2))
    for fd in fds:
        os.set_inheritable(fd, False)  # child processes must not be able to write frames
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    return fds


def own_argv():
    """The command line that started this process, usable from any directory.

    sys.orig_argv holds it in full (`-c <bootstrap.py> <source>` included); a script path given relative to the
    start directory is made absolute.
    """
    argv = [sys.executable] + [a for a in sys.orig_argv[1:] if a != "kernel"]
    script = sys.argv[0] if sys.argv else ""
    if script and script != "-c" and not os.path.isabs(script) and script in argv[1:]:
        index = len(argv) - 1 - argv[::-1].index(script)
        argv[index] = os.path.abspath(script)
    return argv


KERNEL_ARGV = None  # the command line of the kernel role, set in agent_main()


def agent_main():
    global WRITER, LOG_FD, AGENT, CREDS, KERNEL_ARGV
    argv = own_argv()
    KERNEL_ARGV = argv + ["kernel"]
    proto_in, proto_out, LOG_FD = take_protocol_fds()
    CREDS = Credentials()
    if not CREDS.root:
        # On a host (tests): orphans of user processes become our children, so sweeps find them.
        try:
            ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
        except (OSError, AttributeError):
            pass
    try:
        os.chdir("/")
    except OSError:
        pass
    WRITER = ProtocolWriter(proto_out)
    AGENT = Agent(proto_in)
    signal.signal(signal.SIGTERM, lambda *_: shutdown(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not CREDS.root:
        threading.Thread(target=reap_strays, name="reaper", daemon=True).start()
    AGENT.start()
    AGENT.reader_loop()


def reap_strays():
    """On a host the agent is a subreaper: reap adopted orphans (the kernel, commands and jobs are
    reaped by their own Popen)."""
    while True:
        time.sleep(0.5)
        with AGENT.state_lock:
            known = set(AGENT.commands.values()) | {p.pid for p in AGENT.job_procs.values()}
            if AGENT.kernel is not None:
                known.add(AGENT.kernel.pid)
        for pid, info in read_processes().items():
            if info.ppid == os.getpid() and info.state == "Z" and pid not in known:
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass


def kernel_main():
    global WRITER
    fds = os.environ.pop(ENV_KERNEL_FDS)
    proto_in, proto_out = (int(fd) for fd in fds.split(","))
    for fd in (proto_in, proto_out):
        os.set_inheritable(fd, False)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # user code reading stdin gets EOF
    os.close(devnull)
    WRITER = ProtocolWriter(proto_out)
    runner = CellRunner(proto_in)
    runner.start()
    threading.Thread(target=runner.reader_loop, name="reader", daemon=True).start()
    runner.warm_up()
    runner.main_loop()


if __name__ == "__main__":
    try:
        if sys.argv[1:] == ["kernel"]:
            kernel_main()
        else:
            agent_main()
    except BaseException:
        # Make a start-up failure visible in the container log.
        log(f"fatal: {traceback.format_exc()}")
        shutdown(1)
