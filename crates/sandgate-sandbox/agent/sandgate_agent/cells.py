"""The kernel role (uid 1000): runs the `exec` requests the agent sends, one at a time, on its main
thread, with output captured at the descriptor level and interrupts delivered as SIGINT."""

import collections
import os
import platform
import signal
import sys
import threading
import time
import traceback

from .config import DEFAULT_OUTPUT_LIMIT, ENV_KERNEL_FDS, HOME
from .display import PRELOAD, Figures, ThreadMuted, module_present
from .output import FdCapture, OutputSink
from .protocol import FrameServer, OpError, int_arg
from .reseed import reseed
from .runtime import Runtime
from .shells import IPythonKernel, PlainKernel


class CellRunner(FrameServer):
    """The kernel role: runs `exec` requests from the agent on its main thread, one at a time."""

    def __init__(self, rt, proto_in):
        super().__init__(rt, proto_in)
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
        # Set once the shell exists and the background import of the data stack has ended
        # (done, failed or never started): what `preload_wait` waits for.
        self.preload_done = threading.Event()

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
        self.figures = Figures(self.capture, self.writer)
        # Ready before anything heavy is imported: a cell sent now waits in the queue until the
        # shell exists (warm_up), and one that uses the data stack waits, in Python's per-module
        # import lock, only for the modules it imports (see preload_in_background).
        self.preloaded = [name for name in PRELOAD if module_present(name)]
        self.writer.send(
            {
                "event": "ready",
                "pid": self.rt.pid,
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
            self.kernel = IPythonKernel(self.figures, self.rt.log)
        except ImportError:
            self.kernel = PlainKernel()
        except Exception:  # a broken IPython install must not take the sandbox down
            self.kernel = PlainKernel()
        signal.signal(signal.SIGINT, self.on_sigint)
        try:
            threading.Thread(target=self.preload_in_background, name="preload", daemon=True).start()
        except RuntimeError as err:  # at the process limit: cells import what they use themselves
            self.rt.log(f"no background import of the data stack: {err!r}")
            self.preload_done.set()

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
                    self.rt.log(f"preloading {name} failed: {err!r}")
        finally:
            # Put the streams back unless a cell has replaced them meanwhile.
            if sys.stdout is quiet[0]:
                sys.stdout = quiet[0].inner
            if sys.stderr is quiet[1]:
                sys.stderr = quiet[1].inner
            self.preload_done.set()

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
            self.writer.event(req["id"], "started")
            try:
                self.run_exec(req)
            except Exception as err:  # a bug: report it and keep serving
                self.writer.error(req["id"], "internal", f"kernel error: {err!r}")
            finally:
                with self.state_lock:
                    self.running_exec = None

    def run_exec(self, req):
        req_id = req["id"]
        sink = OutputSink(self.writer, req_id, req["output_limit"])
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
        self.writer.ok(
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

    def op_preload_wait(self, req_id, frame):
        """For the agent's `preloaded`: answers once the data stack's background import has ended
        (or after `timeout_ms`), on a thread of its own, so the reader thread stays free."""
        timeout_ms = int_arg(frame, "timeout_ms", 0)
        self.spawn("preload_wait", self.answer_preloaded, req_id, timeout_ms / 1000.0)

    def answer_preloaded(self, req_id, timeout):
        done = self.preload_done.wait(timeout)
        kernel = self.kernel
        self.writer.ok(
            req_id,
            {
                "done": done,
                "modules": [name for name in self.preloaded if name in sys.modules],
                "next_count": kernel.next_count() if kernel is not None else None,
            },
        )

    def op_env(self, req_id, frame):
        """For the agent's `egress_env`: the proxy variables into this process's environment (the
        next `requests`, `urllib` or `!curl` of a cell reads them), on the reader thread."""
        env = frame.get("set")
        unset = frame.get("unset")
        if not isinstance(env, dict) or not isinstance(unset, list):
            raise OpError("bad_request", "env needs an object 'set' and a list 'unset'")
        for name in unset:
            if isinstance(name, str):
                os.environ.pop(name, None)
        for name, value in env.items():
            if isinstance(name, str) and isinstance(value, str):
                os.environ[name] = value
        self.writer.ok(req_id, {"set": sorted(k for k in env if isinstance(k, str))})

    def op_reseed(self, req_id, frame):
        """After a restore (the agent's `restored`): fresh generators for this process, on the
        reader thread, so a running cell does not hold it up."""
        try:
            seed = bytes.fromhex(frame.get("seed") or "")
        except (TypeError, ValueError):
            raise OpError("bad_request", "reseed needs a hex 'seed'") from None
        if len(seed) < 32:
            raise OpError("bad_request", "reseed needs a seed of at least 32 bytes")
        self.writer.ok(req_id, {"reseeded": reseed(seed)})


def main(rt_ready=None, archive_fd=None):
    """The kernel role's start: takes its pipes to the agent, says ready, runs cells for ever.
    `rt_ready` (main.py) is told the runtime."""
    fds = os.environ.pop(ENV_KERNEL_FDS)
    proto_in, proto_out = (int(fd) for fd in fds.split(","))
    for fd in (proto_in, proto_out):
        os.set_inheritable(fd, False)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # user code reading stdin gets EOF
    os.close(devnull)
    rt = Runtime("kernel", proto_out)
    if rt_ready is not None:
        rt_ready(rt)
    runner = CellRunner(rt, proto_in)
    runner.start()
    threading.Thread(target=runner.reader_loop, name="reader", daemon=True).start()
    runner.warm_up()
    runner.main_loop()
