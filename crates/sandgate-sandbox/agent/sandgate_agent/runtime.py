"""The state one agent process shares between its parts: one `Runtime`, made at start-up (main.py)
and handed to every part that writes frames, logs, acts as the sandbox user or starts processes.

It replaces what were module globals rebound at start-up. It is also where the process's identity
lives (`pid`, and whatever the gateway will tell it): a sandbox restored from a memory snapshot
would be told its new identity by an op of the supervisor (supervisor.py), which updates this
object and has the kernel (cells.py, `CellRunner`, with its own Runtime) re-seed its random
generators."""

import os
import threading

from .protocol import ProtocolWriter


class Runtime:
    """One process's shared state: its protocol writer, its log, its credentials and, in the agent
    role, how to start a kernel and what to stop on the way out."""

    def __init__(self, role, proto_out, log_fd=None, creds=None, kernel_argv=None, archive_fd=None):
        self.role = role  # "agent" or "kernel"
        self.pid = os.getpid()  # what the ready frame and ping report
        # The sandbox id the gateway gave it after a restore from a snapshot (`restored`); None in
        # a sandbox that was started, not restored (the gateway knows it by its container).
        self.sandbox_id = None
        # The agent: a duplicate of the original stderr (the container log); the kernel: None.
        self.log_fd = log_fd
        # The agent: processes.Credentials; the kernel never switches users and has None.
        self.creds = creds
        # The agent: the command line that starts a kernel (its own plus "kernel").
        self.kernel_argv = kernel_argv
        # The agent started through bootstrap.py: the descriptor of the (sealed) archive it runs
        # from, which the kernel inherits.
        self.archive_fd = archive_fd
        # Starting a user process and recording it where the supervisor's `keep_roots` finds it
        # happen under this lock, and each round of a sweep decides and kills under it: a sweep
        # (another call ending) never sees a process that was started but not yet recorded, and
        # so never kills a call that is just starting.
        self.spawn_lock = threading.Lock()
        # The agent: variables the gateway gave user processes on top of their own (the egress
        # proxy's, `egress_env`); kernels and commands started from now on get them.
        self.extra_env = {}
        # A lean sandbox's agent: its kernel fork server (lean.py), which kernels.py asks first.
        self.kernel_forks = None
        # Called (once) by `shutdown` before the process exits: the agent ends what user code left.
        self.on_shutdown = None
        self.writer = ProtocolWriter(proto_out, self)

    def log(self, message):
        """Agent diagnostics go to the original stderr, i.e. the container log, never the
        protocol."""
        if self.log_fd is None:
            return
        try:
            os.write(self.log_fd, f"sandgate-agent: {message}\n".encode("utf-8", "replace"))
        except OSError:
            pass

    def shutdown(self, code):
        """Leaves no user process behind (agent role), then exits at once (the main thread may be
        busy)."""
        if self.on_shutdown is not None:
            try:
                self.on_shutdown()
            except Exception:
                pass
        os._exit(code)
