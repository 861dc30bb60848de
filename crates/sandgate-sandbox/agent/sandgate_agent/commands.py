"""Commands (PROTOCOL.md, "command"): a shell command as the sandbox user, its output streamed, its
process group ended at its end or at its timeout, and what it left behind swept."""

import os
import select
import subprocess
import time

from .config import COMMAND_DRAIN_S, DEFAULT_OUTPUT_LIMIT
from .files import checked_cwd
from .output import OutputSink
from .processes import kill_group, leader_exited, start_user_shell, sweep
from .protocol import OpError, int_arg


class Commands:
    """The running (foreground) commands."""

    def __init__(self, rt, state_lock, spawn, keep_roots, jobs):
        self.rt = rt
        self.writer = rt.writer
        self.state_lock = state_lock
        self.spawn = spawn  # the supervisor's FrameServer.spawn
        self.keep_roots = keep_roots  # the supervisor's: what a sweep spares
        self.jobs = jobs  # background commands go there
        self.commands = {}  # request id -> process group id of a running command

    def ops(self):
        """The ops this part answers, by name."""
        return {"command": self.op_command}

    def roots(self):
        """The process groups of the running commands (call with the state lock held)."""
        return list(self.commands.values())

    def first(self):
        """The id of a running command, None when none runs (call with the state lock held)."""
        return next(iter(self.commands), None)

    def interrupt(self, target):
        """Kills the command `target`'s group; False when no such command runs (call with the
        state lock held)."""
        if target not in self.commands:
            return False
        kill_group(self.commands[target])
        return True

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
        cwd = self.rt.creds.run_as_user(checked_cwd, frame.get("cwd"))
        if frame.get("background"):
            self.jobs.start_job(req_id, command, cwd)
            return
        self.spawn("command", self.run_command, req_id, command, timeout_ms, limit, cwd)

    def run_command(self, req_id, command, timeout_ms, limit, cwd):
        """Runs a foreground command to its end and answers `req_id`."""
        sink = OutputSink(self.writer, req_id, limit)
        script = 'cd -- "$1" || exit 126; exec bash -lc "$2"'
        with self.rt.spawn_lock:
            proc = start_user_shell(self.rt, [script, "sandgate", cwd, command], subprocess.PIPE)
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
            sweep(self.rt, lambda: self.keep_roots(kernel=True))
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        sink.finish()
        rc = proc.returncode
        self.writer.ok(
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
