"""The agent role (root, the container's main process): reads the gateway's requests, hands each op
to the part that owns it (kernels, commands, jobs, files, packages), answers `ping` and
`interrupt`, and ends every user process on the way out."""

import ctypes
import os
import signal
import sys
import threading
import time

from .commands import Commands
from .egress import EgressRelay, fixed_env_names
from .files import Files
from .jobs import Jobs
from .kernels import Cells
from .packages import IndexRelay, prepare_user_site
from .processes import Credentials, kill_group, read_processes, sweep
from .protocol import FrameServer, OpError, int_arg
from .reseed import fresh_seed, reseed
from .runtime import Runtime

# How long `restored` waits for the kernel's answer to its `reseed` (it answers on its reader
# thread, even while a cell runs).
RESEED_TIMEOUT_S = 10.0

# How long `egress_env` waits for the kernel to be ready and to answer (on its reader thread).
ENV_TIMEOUT_S = 30.0

# The longest `preloaded` waits for the data stack's import (and its default).
PRELOAD_TIMEOUT_MS = 300_000


class Agent(FrameServer):
    """The supervisor: one state lock for all its parts, one table of ops."""

    # Ops that run acting as the sandbox user on the reader thread (path checks); their workers
    # switch too.
    USER_OPS = frozenset({"write_file", "read_file", "list_dir"})

    def __init__(self, rt, proto_in):
        super().__init__(rt, proto_in)
        self.state_lock = threading.Lock()
        self.index = IndexRelay(rt)
        self.index.call_for_index = self.call_for_index
        self.egress = EgressRelay(rt)
        self.egress.call_for_egress = self.call_for_index
        self.cells = Cells(
            rt, self.state_lock, self.spawn, self.keep_roots, self.index.port, self.egress.port
        )
        self.jobs = Jobs(rt, self.state_lock, self.spawn)
        self.commands = Commands(rt, self.state_lock, self.spawn, self.keep_roots, self.jobs)
        self.files = Files(rt, self.state_lock, self.spawn)
        self.ops = {
            "ping": self.op_ping,
            "interrupt": self.op_interrupt,
            "index_serve": self.op_index_serve,
            "egress_serve": self.op_egress_serve,
            "egress_env": self.op_egress_env,
            "restored": self.op_restored,
            "preloaded": self.op_preloaded,
        }
        for part in (self.cells, self.jobs, self.commands, self.files):
            self.ops.update(part.ops())

    def start(self):
        """Prepares the user site, starts the package index relay, the egress proxy and the first
        kernel."""
        prepare_user_site(self.rt)
        self.index.start()
        self.egress.start()
        self.cells.start()

    def handler(self, op):
        return self.ops.get(op)

    def dispatch_op(self, op, handler, req_id, frame):
        if op in self.USER_OPS:
            self.rt.creds.run_as_user(handler, req_id, frame)
        else:
            handler(req_id, frame)

    def route_chunk(self, req_id, frame):
        if self.index.route(req_id, frame):
            return
        if self.egress.route(req_id, frame):
            return
        self.files.route_chunk(req_id, frame)

    def call_for_index(self):
        """A running exec or command, whose gateway call can open the package index relay when pip
        asks for it (PROTOCOL.md, `index_wanted`); None when none runs."""
        with self.state_lock:
            if self.cells.running is not None:
                return self.cells.running.id
            return self.commands.first()

    def keep_roots(self, kernel):
        """The roots of the process trees a sweep must spare: running commands and jobs, and the
        kernel's whole tree when `kernel`."""
        with self.state_lock:
            roots = self.commands.roots() + self.jobs.roots()
            if kernel and self.cells.kernel is not None:
                roots.append(self.cells.kernel.pid)
        return roots

    def op_ping(self, req_id, frame):
        with self.state_lock:
            busy = self.cells.running is not None
            kernel_pid = self.cells.kernel.pid if self.cells.kernel else None
        self.writer.ok(
            req_id, {"pong": True, "pid": self.rt.pid, "busy": busy, "kernel_pid": kernel_pid}
        )

    def op_preloaded(self, req_id, frame):
        """Answers once the kernel is ready and its background import of the data stack has ended
        (PROTOCOL.md, `preloaded`), or after `timeout_ms`; runs no cell, so the execution count
        stays where it was (a template checkpointed after it starts its clones at 1)."""
        timeout_ms = int_arg(frame, "timeout_ms", PRELOAD_TIMEOUT_MS)
        self.spawn("preloaded", self.run_preloaded, req_id, min(timeout_ms, PRELOAD_TIMEOUT_MS))

    def run_preloaded(self, req_id, timeout_ms):
        kernel_pid, answer = self.cells.wait_preloaded(timeout_ms / 1000.0)
        answer = answer or {}
        modules = answer.get("modules")
        count = answer.get("next_count")
        self.writer.ok(
            req_id,
            {
                "done": answer.get("done") is True,
                "kernel_pid": kernel_pid,
                "modules": [m for m in modules if isinstance(m, str)] if isinstance(modules, list) else [],
                "next_count": count if isinstance(count, int) and not isinstance(count, bool) else None,
            },
        )

    def op_restored(self, req_id, frame):
        """After a restore from a snapshot (PROTOCOL.md, `restored`): the sandbox's new identity,
        and fresh generators in this process and the kernel's."""
        sandbox_id = frame.get("sandbox_id")
        if not isinstance(sandbox_id, str) or not sandbox_id:
            raise OpError("bad_request", "restored needs a string 'sandbox_id'")
        try:
            seed = bytes.fromhex(frame.get("seed") or "")
        except (TypeError, ValueError):
            raise OpError("bad_request", "restored needs a hex 'seed'") from None
        if len(seed) < 32:
            raise OpError("bad_request", "restored needs a seed of at least 32 bytes")
        self.spawn("restored", self.run_restored, req_id, sandbox_id, seed)

    def run_restored(self, req_id, sandbox_id, seed):
        self.rt.sandbox_id = sandbox_id
        reseeded = reseed(fresh_seed(seed))
        kernel_pid, kernel_reseeded = self.cells.reseed_kernel(fresh_seed(seed), RESEED_TIMEOUT_S)
        self.rt.log(f"restored as {sandbox_id}: re-seeded {reseeded}, kernel {kernel_reseeded}")
        self.writer.ok(
            req_id,
            {
                "sandbox_id": sandbox_id,
                "pid": self.rt.pid,
                "reseeded": reseeded,
                "kernel_pid": kernel_pid,
                "kernel_reseeded": kernel_reseeded,
            },
        )

    def op_interrupt(self, req_id, frame):
        target = frame.get("target")
        if isinstance(target, (dict, list)):
            raise OpError("bad_request", "target must be a request id")
        queued = None
        # One lock over every place the target may be: a cell cannot move from the queue to the
        # kernel between the checks.
        with self.state_lock:
            trouble = self.cells.kernel_trouble
            interrupted = (
                self.cells.interrupt_running(req_id, target)
                or self.commands.interrupt(target)
                or (target is not None and self.index.close(target))
                or (target is not None and self.egress.close(target))
            )
            if not interrupted:
                queued = self.cells.take_queued(target)
                interrupted = queued is not None
        if queued is not None:
            self.cells.answer_cancelled(queued, trouble)
        self.writer.ok(req_id, {"interrupted": interrupted})

    def op_index_serve(self, req_id, frame):
        self.index.serve(req_id)

    def op_egress_serve(self, req_id, frame):
        self.egress.serve(req_id, acks=frame.get("acks") is True)

    def op_egress_env(self, req_id, frame):
        """Egress on or off for this sandbox (PROTOCOL.md, `egress_env`): the proxy variables of
        user processes, the kernel's included, the CA bundle and the secrets' placeholders, and
        whether the proxy asks the gateway at all."""
        proxy = frame.get("proxy")
        if not isinstance(proxy, bool):
            raise OpError("bad_request", "egress_env needs a boolean 'proxy'")
        ca_pem = frame.get("ca_pem")
        if ca_pem is not None and not isinstance(ca_pem, str):
            raise OpError("bad_request", "egress_env's 'ca_pem' must be a PEM text")
        placeholders = frame.get("placeholders") or {}
        if not isinstance(placeholders, dict):
            raise OpError("bad_request", "egress_env's 'placeholders' must be an object")
        self.spawn("egress_env", self.run_egress_env, req_id, proxy, ca_pem, placeholders)

    def run_egress_env(self, req_id, proxy, ca_pem=None, placeholders=None):
        gone = self.egress.set_enabled(proxy, ca_pem, placeholders)
        env = self.egress.env()
        names = fixed_env_names() + gone
        self.rt.extra_env = dict(env)
        unset = [name for name in names if name not in env]
        # A kernel still starting has its environment already (it was started with the old
        # one): wait until it is ready to be told.
        deadline = time.monotonic() + ENV_TIMEOUT_S
        while True:
            kernel_pid, applied = self.cells.set_kernel_env(env, unset, ENV_TIMEOUT_S)
            if applied or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        self.writer.ok(
            req_id,
            {
                "proxy": bool(env),
                "port": self.egress.port(),
                "kernel_pid": kernel_pid,
                "kernel_applied": applied,
                "placeholders": sorted(name for name in env if name in self.egress.placeholders),
            },
        )

    def stop(self):
        """Ends the kernel, every command and job and whatever they started (agent exit)."""
        self.cells.stop()
        with self.state_lock:
            groups = self.commands.roots() + self.jobs.roots()
        for pgid in groups:
            kill_group(pgid)
        sweep(self.rt, list)

    def reap_strays(self):
        """On a host the agent is a subreaper: reap adopted orphans (the kernel, commands and jobs
        are reaped by their own Popen)."""
        while True:
            time.sleep(0.5)
            known = set(self.keep_roots(kernel=True))
            for pid, info in read_processes().items():
                if info.ppid == os.getpid() and info.state == "Z" and pid not in known:
                    try:
                        os.waitpid(pid, os.WNOHANG)
                    except ChildProcessError:
                        pass


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


def kernel_argv(archive_fd):
    """The command line that starts a kernel: this process's own, usable from any directory, plus
    `kernel`.

    sys.orig_argv holds it in full (`-c <bootstrap.py> <archive>` included). Started through
    bootstrap.py (`archive_fd`), the kernel inherits the archive's descriptor instead of a copy of
    it as an argument (the last one); a script (or archive) path given relative to the start
    directory is made absolute.
    """
    argv = [sys.executable] + [a for a in sys.orig_argv[1:] if a not in ("kernel", "zygote")]
    if archive_fd is not None:
        argv.pop()
    script = sys.argv[0] if sys.argv else ""
    if script and script != "-c" and not os.path.isabs(script) and script in argv[1:]:
        index = len(argv) - 1 - argv[::-1].index(script)
        argv[index] = os.path.abspath(script)
    return argv + ["kernel"]


def main(rt_ready=None, archive_fd=None, forkserver=None):
    """The agent role's start: takes the protocol descriptors, starts the first kernel and serves
    the gateway's requests until its input ends. `rt_ready` (main.py) is told the runtime.
    `forkserver` (a lean sandbox, zygote.py): starts the kernel fork server (lean.py), called
    before any thread exists."""
    creds = Credentials()  # before the descriptors are taken: a failure shows in the container log
    proto_in, proto_out, log_fd = take_protocol_fds()
    forks = None
    if forkserver is not None:
        reseed(fresh_seed(b""))  # the agent is a copy of the zygote too
        forks = forkserver(archive_fd, log_fd)
    if not creds.root:
        # On a host (tests): orphans of user processes become our children, so sweeps find them.
        try:
            ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
        except (OSError, AttributeError):
            pass
    try:
        os.chdir("/")
    except OSError:
        pass
    rt = Runtime(
        "agent",
        proto_out,
        log_fd=log_fd,
        creds=creds,
        kernel_argv=kernel_argv(archive_fd),
        archive_fd=archive_fd,
    )
    rt.kernel_forks = forks
    if forks is not None:
        forks.begin()
    if rt_ready is not None:
        rt_ready(rt)
    agent = Agent(rt, proto_in)
    rt.on_shutdown = agent.stop
    signal.signal(signal.SIGTERM, lambda *_: rt.shutdown(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if not creds.root or forks is not None:
        # On a host, and as a lean sandbox's pid 1: orphans of user processes come to us.
        threading.Thread(target=agent.reap_strays, name="reaper", daemon=True).start()
    agent.start()
    agent.reader_loop()
