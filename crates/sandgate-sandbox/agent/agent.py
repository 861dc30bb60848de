"""sandgate sandbox agent: the main process of every sandbox container.

It speaks the newline-delimited JSON protocol described in PROTOCOL.md (next to this file) over the
container's attached stdin/stdout and runs, for the gateway:

* ``exec``: Python cells in a persistent kernel (an IPython ``InteractiveShell`` when IPython is
  importable, plain ``exec`` otherwise) on the main thread, one at a time;
* ``command``: shell commands (``bash -lc``) in their own process groups, concurrently;
* file operations confined to the home directory, plus ``interrupt``, ``restart`` and ``ping``.

It is stdlib-only on purpose: the Rust gateway embeds this file and starts it as
``python3 -u -c <source>``, so any image with python3 can be a sandbox profile. IPython, numpy,
pandas and matplotlib are used when present and skipped when not.

Threads:

* the *reader* thread parses frames from the protocol input and dispatches them. Control ops are
  answered on it directly (``interrupt``, ``ping``) or handed to a worker thread (file ops,
  commands), so nothing a cell does can delay them; ``exec`` requests go to a queue;
* the *main* thread drains that queue. Cells must run there because signals (and therefore
  ``KeyboardInterrupt``) are only delivered to the main thread, and because user code (matplotlib,
  ``signal.signal``) assumes it;
* two *pump* threads drain the pipes that fd 1 and fd 2 point at and turn their bytes into
  ``stdout``/``stderr`` events of the running ``exec``.

Environment: ``SANDGATE_AGENT_HOME`` overrides the home directory (default ``/home/user``), so the
agent can be tested on a host.
"""

import ast
import base64
import binascii
import codecs
import collections
import errno
import fcntl
import hashlib
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

PROTOCOL_VERSION = 1

HOME = os.path.realpath(os.environ.get("SANDGATE_AGENT_HOME") or "/home/user")

# Defaults for arguments the gateway normally always sends.
DEFAULT_OUTPUT_LIMIT = 1 << 20
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

# Private state handed to the next incarnation of the agent across os.execv (restart).
ENV_FDS = "SANDGATE_AGENT_FDS"
ENV_PENDING = "SANDGATE_AGENT_PENDING"

ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def strip_ansi(text):
    return ANSI_ESCAPE.sub("", text)


# --------------------------------------------------------------------------------------------------
# Protocol output


class ProtocolWriter:
    """Writes frames to the private duplicate of the original stdout.

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
        with self.lock:
            view = memoryview(line)
            try:
                while view:
                    written = os.write(self.fd, view)
                    view = view[written:]
            except OSError as err:
                # The gateway is gone: nobody can receive results any more. Do not leave command
                # process groups behind.
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
LOG_FD = None  # duplicate of the original stderr (the container log), set in main()


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
# Confinement is checked on the resolved path. The agent runs as the same uid as user code, so this
# is a guard against gateway/model mistakes, not a security boundary against code in the sandbox
# (the container is that boundary); a cell racing a symlink swap against a file op only reaches what
# it could reach anyway.


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
        plt = sys.modules.get("matplotlib.pyplot")
        if plt is None or getattr(plt.show, "_sandgate", False):
            return

        def show(*args, **kwargs):
            self.flush()

        show._sandgate = True
        show.__doc__ = "Display all open figures (sandgate: as display events) and close them."
        plt.show = show

    def flush(self):
        """Emits every open figure and closes it."""
        plt = sys.modules.get("matplotlib.pyplot")
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
# The agent


class Agent:
    def __init__(self, proto_in, proto_out, pending):
        self.proto_in = proto_in
        self.proto_out = proto_out
        self.buffer = bytearray(pending)
        self.scanned = 0  # bytes of buffer already known to hold no newline
        self.main_ident = threading.get_ident()
        self.state_lock = threading.Lock()
        # exec queue, drained by the main thread (PROTOCOL.md, exec: "in request order").
        self.exec_queue = collections.deque()
        self.exec_ready = threading.Condition(self.state_lock)
        self.running_exec = None  # id of the exec running on the main thread
        self.interruptible = False  # True only while user code runs (see on_sigint)
        # Set by `interrupt` for the running exec: covers an interrupt that arrives after the cell
        # was taken from the queue but before its code started (the signal alone would be dropped).
        self.interrupt_requested = False
        # Set when on_sigint has actually raised KeyboardInterrupt for the current interrupt.
        self.interrupt_delivered = False
        self.commands = {}  # request id -> process group id of a running command
        self.uploads = {}  # request id -> queue of chunk frames of a running write_file
        self.upload_tmp = {}  # request id -> temporary file of a running write_file
        self.capture = None
        self.figures = None
        self.kernel = None
        self.preloaded = []

    # ----- start-up

    def start(self):
        self.capture = FdCapture()
        # The gateway passes -u; should it not, print output would wait in Python's buffer and
        # arrive after that of child processes. (Harmless when -u already made it unbuffered.)
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=True)
        try:
            os.makedirs(HOME, exist_ok=True)
            os.chdir(HOME)
        except OSError as err:
            log(f"cannot enter {HOME}: {err}")
        os.environ["MPLBACKEND"] = "Agg"
        # IPython wants a writable profile directory; keep it out of the user's home (and quota).
        if "IPYTHONDIR" not in os.environ:
            os.environ["IPYTHONDIR"] = os.path.join(tempfile.gettempdir(), "sandgate-ipython")
        self.figures = Figures(self.capture)
        self.preload()
        try:
            self.kernel = IPythonKernel(self.figures)
        except ImportError:
            self.kernel = PlainKernel()
        except Exception as err:  # a broken IPython install must not take the sandbox down
            log(f"IPython unusable, using plain exec: {err!r}")
            self.kernel = PlainKernel()
        signal.signal(signal.SIGINT, self.on_sigint)
        signal.signal(signal.SIGTERM, lambda *_: shutdown(0))
        WRITER.send(
            {
                "event": "ready",
                "protocol": PROTOCOL_VERSION,
                "pid": os.getpid(),
                "python": platform.python_version(),
                "ipython": isinstance(self.kernel, IPythonKernel),
                "preloaded": self.preloaded,
            }
        )

    def preload(self):
        """Imports the data stack now so that the first cell of a leased sandbox starts at once."""
        for name in ("numpy", "pandas", "matplotlib"):
            try:
                __import__(name)
                if name == "matplotlib":
                    import matplotlib

                    matplotlib.use("Agg")
                    import matplotlib.pyplot  # noqa: F401  (the slow part of the import)

                    self.figures.patch_pyplot()
            except Exception as err:  # missing or broken: skipped, as the protocol allows
                log(f"preload of {name} skipped: {err!r}")
                continue
            self.preloaded.append(name)

    # ----- main thread: cells

    def on_sigint(self, signum, frame):
        # Interrupts are aimed at user code. One that lands while the agent itself runs (the cell has
        # just finished) is dropped rather than breaking the agent's bookkeeping.
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
                self.interrupt_requested = False
            try:
                self.run_exec(req)
            except Exception as err:  # an agent bug: report it and keep serving
                log(f"exec failed: {traceback.format_exc()}")
                WRITER.error(req["id"], "internal", f"agent error: {err!r}")
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
        # Not running any more before the answer goes out: a ping or interrupt that follows the
        # result must not see this cell as busy.
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

    # ----- reader thread: frames

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
        # Protocol input closed: the gateway is gone for good (PROTOCOL.md: exit on EOF).
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
            handler(req_id, frame)
        except OpError as err:
            WRITER.error(req_id, err.kind, err.message)
        except Exception as err:  # an agent bug: this request fails, the agent lives on
            log(f"{op} failed: {traceback.format_exc()}")
            WRITER.error(req_id, "internal", f"agent error: {err!r}")

    def spawn(self, name, target, req_id, *args):
        """Runs a request on its own thread; its OpError or crash becomes the final frame."""

        def run():
            try:
                target(req_id, *args)
            except OpError as err:
                WRITER.error(req_id, err.kind, err.message)
            except Exception as err:
                log(f"{name} failed: {traceback.format_exc()}")
                WRITER.error(req_id, "internal", f"agent error: {err!r}")

        threading.Thread(target=run, name=f"{name}-{req_id}", daemon=True).start()

    # ----- ops

    def op_ping(self, req_id, frame):
        with self.state_lock:
            busy = self.running_exec is not None
        WRITER.ok(req_id, {"pong": True, "pid": os.getpid(), "busy": busy})

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
        if isinstance(target, (dict, list)):
            raise OpError("bad_request", "target must be a request id")
        interrupted = False
        queued = None
        with self.state_lock:
            if target is not None and target == self.running_exec:
                self.interrupt_requested = True
                self.interrupt_delivered = False
                # A real signal (not _thread.interrupt_main) so that blocking calls such as
                # time.sleep are woken with EINTR; the handler then raises KeyboardInterrupt.
                signal.pthread_kill(self.main_ident, signal.SIGINT)
                threading.Thread(
                    target=self.keep_interrupting, args=(target,), name="interrupt", daemon=True
                ).start()
                interrupted = True
            elif target in self.commands:
                kill_group(self.commands[target])
                interrupted = True
            else:
                for req in self.exec_queue:
                    if req["id"] == target:
                        queued = req
                        self.exec_queue.remove(req)
                        interrupted = True
                        break
            next_count = self.kernel.next_count()
        if queued is not None:
            # Answered before the interrupt's own result, so the gateway sees the cell settled.
            # It never ran, so it did not take an execution count; the number reported is the one
            # the next cell will get.
            WRITER.ok(
                queued["id"],
                {
                    "execution_count": next_count,
                    "result": None,
                    "error": {
                        "name": "KeyboardInterrupt",
                        "value": "interrupted before it started",
                        "traceback": [],
                    },
                    "truncated": False,
                },
            )
        WRITER.ok(req_id, {"interrupted": interrupted})

    def op_restart(self, req_id, frame):
        kill_all_commands(self)
        # Hold the frame lock until exec: no other thread may start a frame the new process would
        # never finish.
        with WRITER.lock:
            line = json.dumps(
                {"id": req_id, "ok": True, "result": {"restarting": True}}, separators=(",", ":")
            )
            os.write(self.proto_out, (line + "\n").encode())
            # Frames already read past the restart line belong to the next incarnation.
            if self.buffer:
                fd, pending_path = tempfile.mkstemp(prefix="sandgate-agent-pending-")
                with os.fdopen(fd, "wb") as f:
                    f.write(self.buffer)
                os.environ[ENV_PENDING] = pending_path
            os.environ[ENV_FDS] = f"{self.proto_in},{self.proto_out},{LOG_FD}"
            for fd in (self.proto_in, self.proto_out, LOG_FD):
                os.set_inheritable(fd, True)
            # Uploads cut off by the restart will never finish; do not leave their temp files.
            with self.state_lock:
                partial = list(self.upload_tmp.values())
            for path in partial:
                try:
                    os.unlink(path)
                except OSError:
                    pass
            os.execv(RESTART_ARGV[0], RESTART_ARGV)

    def op_command(self, req_id, frame):
        command = frame.get("command")
        if not isinstance(command, str):
            raise OpError("bad_request", "command needs a string 'command'")
        timeout_ms = frame.get("timeout_ms")
        if timeout_ms is not None and (not isinstance(timeout_ms, (int, float)) or timeout_ms < 0):
            raise OpError("bad_request", "timeout_ms must be a non-negative number")
        limit = int_arg(frame, "output_limit", DEFAULT_OUTPUT_LIMIT)
        cwd = resolve_path(frame.get("cwd"))
        if not os.path.exists(cwd):
            raise OpError("not_found", f"{cwd} does not exist")
        if not os.path.isdir(cwd):
            raise OpError("not_a_directory", f"{cwd} is not a directory")
        self.spawn("command", self.run_command, req_id, command, timeout_ms, limit, cwd)

    def run_command(self, req_id, command, timeout_ms, limit, cwd):
        sink = OutputSink(req_id, limit)
        try:
            proc = subprocess.Popen(
                ["bash", "-lc", command],
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as err:
            raise OpError("io", f"cannot start bash: {err}")
        pgid = proc.pid  # start_new_session: the child leads its own session and group
        with self.state_lock:
            self.commands[req_id] = pgid
        timed_out = False
        pidfd = None
        try:
            streams = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr"}
            for fd in streams:
                os.set_blocking(fd, False)
            try:
                pidfd = os.pidfd_open(proc.pid)  # becomes readable when the process exits
            except (AttributeError, OSError):
                pass  # old kernel or gVisor without pidfd: poll below instead
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
                    # (setsid) could hold them open for ever.
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
            with self.state_lock:
                self.commands.pop(req_id, None)
            # Killed while the leader is still unreaped (see leader_exited), so the group id cannot
            # have been reused yet.
            kill_group(pgid)
            proc.wait()
            if pidfd is not None:
                os.close(pidfd)
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
        self.spawn("write_file", self.run_write, req_id, target, size, overwrite, chunks)

    def route_chunk(self, req_id, frame):
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
        self.spawn("read_file", self.run_read, req_id, target, max_bytes)

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
        WRITER.ok(req_id, {"path": target, "size": size, "sha256": digest.hexdigest()})

    def op_list_dir(self, req_id, frame):
        target = resolve_path(frame.get("path"))
        self.spawn("list_dir", self.run_list_dir, req_id, target)

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
        WRITER.ok(req_id, {"path": target, "entries": entries})


# The name the agent's own code objects carry ("<string>" when run with -c).
AGENT_FILE = Agent.on_sigint.__code__.co_filename


def int_arg(frame, name, default):
    value = frame.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise OpError("bad_request", f"{name} must be a non-negative integer")
    return value


def leader_exited(pid):
    """True once `pid` has exited, without reaping it.

    WNOWAIT leaves the process a zombie, so its pid, which is also the id of its process group,
    cannot be taken by an unrelated process before we have killed the group.
    """
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped by someone else (user code calling os.wait())
        return True


def current_umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def kill_group(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


AGENT = None


def kill_all_commands(agent):
    if agent is None:
        return
    with agent.state_lock:
        groups = list(agent.commands.values())
    for pgid in groups:
        kill_group(pgid)


def shutdown(code):
    """Leaves no command process group behind, then exits at once (the main thread may be busy)."""
    kill_all_commands(AGENT)
    os._exit(code)


def take_protocol_fds():
    """Returns (input, output, log) descriptors, private to the agent.

    The first incarnation duplicates the container's stdin/stdout/stderr; after a restart they are
    inherited through os.execv and named in an environment variable.
    """
    inherited = os.environ.pop(ENV_FDS, None)
    if inherited:
        fds = tuple(int(fd) for fd in inherited.split(","))
    else:
        fds = tuple(os.dup(fd) for fd in (0, 1, 2))
    for fd in fds:
        os.set_inheritable(fd, False)  # child processes must not be able to write frames
    # User code (and its children) reading stdin get EOF instead of stealing frames.
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return fds


def take_pending_input():
    path = os.environ.pop(ENV_PENDING, None)
    if not path:
        return b""
    try:
        with open(path, "rb") as f:
            data = f.read()
        os.unlink(path)
        return data
    except OSError:
        return b""


RESTART_ARGV = None  # the command line to os.execv on restart, set in main()


def restart_argv():
    """The command line that started this agent, usable after chdir.

    sys.orig_argv holds it in full (`-c <source>` included); a script path given relative to the
    start directory is made absolute, since the agent changes directory to its home.
    """
    argv = [sys.executable] + list(sys.orig_argv[1:])
    script = sys.argv[0] if sys.argv else ""
    if script and script != "-c" and not os.path.isabs(script) and script in argv[1:]:
        index = len(argv) - 1 - argv[::-1].index(script)
        argv[index] = os.path.abspath(script)
    return argv


def main():
    global WRITER, LOG_FD, AGENT, RESTART_ARGV
    RESTART_ARGV = restart_argv()
    proto_in, proto_out, LOG_FD = take_protocol_fds()
    WRITER = ProtocolWriter(proto_out)
    AGENT = Agent(proto_in, proto_out, take_pending_input())
    AGENT.start()
    threading.Thread(target=AGENT.reader_loop, name="reader", daemon=True).start()
    AGENT.main_loop()


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        # fd 2 is a pipe nobody reports by now; make a start-up failure visible in the container log.
        log(f"fatal: {traceback.format_exc()}")
        shutdown(1)
