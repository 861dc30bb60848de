"""The agent's side of the kernel (PROTOCOL.md, "exec", "interrupt", "restart" and "The kernel is
not the agent"): starting the uid-1000 kernel process, queueing cells for it, relaying the frames
of the cell it runs (and nothing else), and replacing it when it dies or is restarted."""

import collections
import fcntl
import json
import os
import platform
import queue
import subprocess
import threading
import time

from .config import (
    AT_PROCESS_LIMIT,
    DEFAULT_OUTPUT_LIMIT,
    DISPLAY_LIMIT,
    ENV_ARCHIVE_FD,
    ENV_KERNEL_FDS,
    HOME,
    KERNEL_READY_S,
    MARKER_SLACK,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    READ_AFTER_EXIT_S,
)
from .processes import describe_exit, leader_exited, oom_kills, pids_refusals, sweep, user_env
from .protocol import OpError, int_arg


def archive_for_kernel(archive_fd):
    """A copy of the agent's archive (bootstrap.py's memfd, which only root can open) for one
    kernel to import the package from: readable by the sandbox user, sealed against writes. The
    agent closes its descriptor once the kernel has started, so the copy is the kernel's alone."""
    size = os.fstat(archive_fd).st_size
    fd = os.memfd_create("sandgate-agent-kernel", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        # In the kernel (sendfile): no copy passes through this process's heap, which would keep it.
        offset = 0
        while offset < size:
            sent = os.sendfile(fd, archive_fd, offset, size - offset)
            if sent == 0:
                raise OSError(f"the agent's archive ended after {offset} of {size} bytes")
            offset += sent
        os.fchmod(fd, 0o444)
        seals = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return fd


class KernelProcess:
    """One incarnation of the kernel: the uid-1000 process and its two pipes to the agent.

    `agent` is told of its frames and its exit (on_kernel_line, on_kernel_junk, on_kernel_exit)."""

    def __init__(self, rt, agent):
        to_kernel_r, to_kernel_w = os.pipe()
        from_kernel_r, from_kernel_w = os.pipe()
        forks = getattr(rt, "kernel_forks", None)
        lean = forks is not None and forks.alive
        env = {ENV_KERNEL_FDS: f"{to_kernel_r},{from_kernel_w}"}
        archive = ()
        if rt.archive_fd is not None and not lean:
            try:
                archive = (archive_for_kernel(rt.archive_fd),)
            except OSError:
                os.close(to_kernel_r)
                os.close(to_kernel_w)
                os.close(from_kernel_r)
                os.close(from_kernel_w)
                raise
            env[ENV_ARCHIVE_FD] = str(archive[0])
        self.oom_before = oom_kills()
        self.pids_before = pids_refusals()
        try:
            if lean:
                # A lean sandbox: a fork of the agent's fork server, pandas-ready (lean.py).
                self.proc = forks.spawn(to_kernel_r, from_kernel_w, user_env(rt))
            else:
                self.proc = subprocess.Popen(
                    rt.kernel_argv,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    pass_fds=(to_kernel_r, from_kernel_w) + archive,
                    env=user_env(rt, env),
                    cwd="/",
                    start_new_session=True,  # signals aimed at the agent's group never reach it
                    **rt.creds.popen_args(),
                )
        finally:
            for fd in (to_kernel_r, from_kernel_w) + archive:
                os.close(fd)
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
        """Sends a frame to the kernel."""
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

    def exited(self):
        """Whether the kernel process has exited (a forked one is not our child: its fork server
        tells us)."""
        if isinstance(self.proc, subprocess.Popen):
            return leader_exited(self.pid)
        return self.proc.poll() is not None

    def kill(self):
        """SIGKILL to the kernel process (not its group: the sweep that follows ends the rest)."""
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


class Cells:
    """The cells of the sandbox: the current kernel, the exec queue and the cell the kernel runs.

    Its state is guarded by the supervisor's state lock, which it shares with the other parts."""

    def __init__(self, rt, state_lock, spawn, keep_roots, index_port, egress_port):
        self.rt = rt
        self.writer = rt.writer
        self.state_lock = state_lock
        self.spawn = spawn  # the supervisor's FrameServer.spawn
        self.keep_roots = keep_roots  # the supervisor's: what a sweep spares
        self.index_port = index_port  # the package index relay's port, for the ready frame
        self.egress_port = egress_port  # the egress proxy's port, for the ready frame
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
        # `reseed` requests sent to the kernel after a restore and not yet answered: their id
        # (a string, never a gateway's request id) to [threading.Event, answer frame].
        self.reseeds = {}
        self.reseed_count = 0

    def ops(self):
        """The ops this part answers, by name."""
        return {"exec": self.op_exec, "restart": self.op_restart}

    def start(self):
        """Starts the first kernel."""
        self.start_kernel(lambda kp: setattr(self, "kernel", kp))

    def start_kernel(self, publish):
        """Starts a kernel and hands it to `publish` (under the spawn lock, so that a sweep sees it
        as a root from the start). While the sandbox is at its process limit (a fork bomb, say) the
        start fails; it is tried again until it succeeds, so that the sandbox has a kernel again
        as soon as processes are free. Returns the kernel, or None if the agent stops meanwhile."""
        delay, failures = 0.05, 0
        while not self.stopping:
            with self.rt.spawn_lock:
                try:
                    kp = KernelProcess(self.rt, self)
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
                        self.rt.log(f"kernel {kp.pid} started after {failures} failed attempts")
                    return kp
            if failures == 0:
                self.rt.log(f"cannot start a kernel yet ({failure!r}); trying again until it starts")
            failures += 1
            time.sleep(delay)
            delay = min(delay * 2, 1.0)
        return None

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
        reply_id = frame.get("id")
        if isinstance(reply_id, str):
            with self.state_lock:
                waiter = self.reseeds.get(reply_id) if kp is self.kernel else None
            if waiter is not None:
                waiter[1] = frame
                waiter[0].set()
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
        """The kernel wrote something that is no frame: its running cell counts as truncated."""
        with self.state_lock:
            run = self.running if kp is self.kernel else None
            if run is not None:
                run.junk += 1
                run.truncated = True

    def relay_event(self, run, event, frame):
        """Relays an output or display event of the running cell, within its limits."""
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
            self.writer.event(run.id, event, data=data)
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
            self.writer.event(run.id, "display", **fields)

    def finish_exec(self, run, result, error=None):
        """Answers the running cell (`result` from the kernel, or the kernel's `error`)."""
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
            sweep(self.rt, lambda: self.keep_roots(kernel=False), keep_pids=[kernel_pid])
        else:
            sweep(self.rt, lambda: self.keep_roots(kernel=True))
        if result is None:
            self.writer.error(run.id, "internal", f"the kernel failed the cell: {error}")
        else:
            cell_error = result.get("error")
            value = result.get("result")
            self.writer.ok(
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
            if not kp.ready.is_set() or kp.exited():
                return  # a dead kernel's successor takes the cell when it is ready
            run = self.running = Run(self.exec_queue.popleft())
            kp.send({"id": run.id, "op": "exec", "code": run.code, "output_limit": run.limit})

    def ask_kernel(self, op, fields, timeout):
        """Sends the current kernel an internal request (`op` with `fields`, under an id of our
        own, never a gateway's) and waits up to `timeout` s for its answer. Returns (kernel pid
        or None, the answer's result, or None when no kernel is ready or it did not answer in
        time)."""
        with self.state_lock:
            kp = self.kernel
            if kp is None or not kp.ready.is_set():
                return (kp.pid if kp else None), None
            self.reseed_count += 1
            reply_id = f"{op}-{self.reseed_count}"
            waiter = self.reseeds[reply_id] = [threading.Event(), None]
        kp.send({"id": reply_id, "op": op, **fields})
        answered = waiter[0].wait(timeout)
        with self.state_lock:
            self.reseeds.pop(reply_id, None)
        result = waiter[1].get("result") if answered and waiter[1].get("ok") is True else None
        return kp.pid, result if isinstance(result, dict) else None

    def set_kernel_env(self, env, unset, timeout):
        """Has the current kernel put `env` into its environment and take `unset` out of it (the
        egress proxy's variables, PROTOCOL.md `egress_env`). Returns (kernel pid or None, whether
        it answered within `timeout` s); a kernel started later gets them from `rt.extra_env`."""
        pid, result = self.ask_kernel("env", {"set": env, "unset": unset}, timeout)
        return pid, result is not None

    def reseed_kernel(self, seed, timeout):
        """Has the current kernel re-seed its generators (after a restore, PROTOCOL.md `restored`).
        Returns (kernel pid, what it re-seeded), or (pid or None, None) when no kernel is ready or
        it did not answer within `timeout` s: a kernel started later is a new process, seeded
        afresh by Python itself."""
        pid, result = self.ask_kernel("reseed", {"seed": seed.hex()}, timeout)
        reseeded = result.get("reseeded") if result is not None else None
        return pid, reseeded if isinstance(reseeded, list) else None

    def wait_preloaded(self, timeout):
        """Waits up to `timeout` s for a kernel to be ready and to have ended its background import
        of the data stack (PROTOCOL.md `preloaded`), without running a cell. Returns (kernel pid
        or None, the kernel's answer or None when there was none in time)."""
        deadline = time.monotonic() + timeout
        while True:
            with self.state_lock:
                ready = self.kernel is not None and self.kernel.ready.is_set()
            if ready or time.monotonic() >= deadline or self.stopping:
                break
            time.sleep(0.05)
        left = max(0.0, deadline - time.monotonic())
        # The kernel answers when its import ends or after `left`; the slack covers the relay.
        return self.ask_kernel("preload_wait", {"timeout_ms": int(left * 1000)}, left + 5.0)

    def on_kernel_ready(self, kp, frame):
        """A kernel said ready: the first one makes the agent say ready too."""
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
            self.writer.send(
                {
                    "event": "ready",
                    "protocol": PROTOCOL_VERSION,
                    "pid": self.rt.pid,
                    "kernel_pid": kp.pid,
                    "python": platform.python_version(),
                    "ipython": bool(frame.get("ipython")),
                    "preloaded": [p for p in frame.get("preloaded", []) if isinstance(p, str)],
                    "isolated": self.rt.creds.root,
                    "index_port": self.index_port(),
                    "egress_port": self.egress_port(),
                }
            )
        self.dispatch()

    def on_kernel_exit(self, kp, returncode):
        """The kernel `kp` ended: unless it was replaced on purpose, a fresh one takes over."""
        with self.state_lock:
            current = kp is self.kernel and not self.stopping
            was_ready = kp.ready.is_set()
        if not current:
            return  # replaced on purpose (restart)
        # Frames the kernel wrote before it died (a cell's "started" above all) count: without
        # them a cell that had started would be taken for one that had not, and run again.
        kp.read_all.wait(READ_AFTER_EXIT_S)
        reason = describe_exit(returncode, kp.oom_before, kp.pids_before)
        self.rt.log(f"kernel {kp.pid} ended: {reason}")
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
        sweep(self.rt, lambda: self.keep_roots(kernel=False))
        if run is not None and not run.started and not run.interrupted:
            # The kernel died before it took the cell: the next kernel runs it, and it is told
            # that the state was lost.
            with self.state_lock:
                self.exec_queue.appendleft(run.req)
            run = None
        if run is not None:
            self.writer.ok(
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

    def op_exec(self, req_id, frame):
        code = frame.get("code")
        if not isinstance(code, str):
            raise OpError("bad_request", "exec needs a string 'code'")
        limit = int_arg(frame, "output_limit", DEFAULT_OUTPUT_LIMIT)
        with self.state_lock:
            self.exec_queue.append({"id": req_id, "code": code, "output_limit": limit})
        self.dispatch()

    def interrupt_running(self, req_id, target):
        """Has the kernel interrupt `target` if that is the cell it runs; False otherwise (call
        with the state lock held)."""
        run = self.running
        if target is None or run is None or target != run.id:
            return False
        run.interrupted = True
        self.kernel.send({"id": req_id, "op": "interrupt", "target": target})
        return True

    def take_queued(self, target):
        """Takes the cell `target` out of the queue and returns its request; None when it is not
        queued (call with the state lock held)."""
        for req in self.exec_queue:
            if req["id"] == target:
                self.exec_queue.remove(req)
                return req
        return None

    def answer_cancelled(self, queued, trouble):
        """Answers a cell interrupted while it waited in the queue."""
        # Answered before the interrupt's own result, so the gateway sees the cell settled. It
        # never ran, so it did not take an execution count; the number reported is the one the
        # next cell will get.
        self.writer.ok(
            queued["id"],
            {
                "execution_count": self.next_count,
                "result": None,
                "error": {
                    "name": "KeyboardInterrupt",
                    "value": "interrupted before it started" + (f" ({trouble})" if trouble else ""),
                    "traceback": [],
                },
                "truncated": False,
                "state_lost": False,
                "state_lost_reason": None,
            },
        )

    def stop(self):
        """Kills the kernel for good (agent exit): no successor starts."""
        with self.state_lock:
            self.stopping = True
            kp = self.kernel
        if kp is not None:
            kp.kill()

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
        self.writer.ok(req_id, {"restarted": True, "kernel_pid": new.pid})
