"""The zygote role (the lean engine; docs/architecture.md, "The lean engine"): one root-owned
Python per node and image that has imported the agent and the data stack once, and forks one child
per sandbox.

The node starts it inside the image's root filesystem (`python3 -u -c <bootstrap.py> <archive>
zygote`) with two descriptors: a `SOCK_SEQPACKET` socket to the node (SANDGATE_ZYGOTE_FD), the
only way to reach it, and a sealed memory file holding the node's `libsandgate_lean.so`
(SANDGATE_LEAN_LIB_FD), the Rust code that runs between each fork and the first line of sandbox
code. This module only calls that library; it decides nothing about isolation itself.

Messages are JSON objects, one per packet:
- zygote -> node, once: `{"op": "ready", "abi", "source", "pid", "threads", "modules"}` (the
  library's interface version and source hash);
- node -> zygote: `{"op": "spawn", "id", "spec"}` with two descriptors attached, the sandbox's
  protocol socket (its stdin and stdout) and the write end of its stderr pipe; answered with
  `{"op": "spawned", "id", "pid"}` or `{"op": "refused", "id", "error"}`;
- zygote -> node, whenever it reaps a child: `{"op": "exited", "pid", "code"}` (the exit code, or
  minus the signal's number);
- node -> zygote: `{"op": "stats"}`, answered with `{"op": "stats", "threads", "cpu_s",
  "children"}`.

The zygote holds no secret and no tenant data, ever: nothing of a sandbox passes through it but
the spec of its container. It ends when the node's socket closes; its children live on.
"""

import ctypes
import gc
import json
import os
import resource
import select
import signal
import socket
import sys

from . import config

ENV_SOCKET_FD = "SANDGATE_ZYGOTE_FD"
ENV_LIB_FD = "SANDGATE_LEAN_LIB_FD"

# The data stack a sandbox finds imported (what the Docker engine's kernels import in the
# background), and the agent's own modules (a child never reads the archive again for them).
DATA_STACK = ("numpy", "pandas", "matplotlib", "matplotlib.pyplot", "IPython")
AGENT_MODULES = (
    "cells", "commands", "config", "display", "egress", "files", "jobs", "kernels", "lean",
    "output", "packages", "processes", "protocol", "reseed", "runtime", "shells", "supervisor",
)

MAX_MESSAGE = 1 << 16
ERR_LEN = 1024


class Library:
    """The node's libsandgate_lean.so, loaded from its sealed memory file."""

    def __init__(self, fd):
        self.lib = ctypes.CDLL(f"/proc/self/fd/{fd}")
        for name in ("sg_lean_prepare", "sg_lean_before_fork", "sg_lean_after_fork"):
            getattr(self.lib, name).argtypes = (ctypes.c_char_p, ctypes.c_size_t)
            getattr(self.lib, name).restype = ctypes.c_int
        self.lib.sg_lean_enter.argtypes = (
            ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_size_t
        )
        self.lib.sg_lean_enter.restype = ctypes.c_int
        self.lib.sg_lean_abi_version.restype = ctypes.c_uint32
        self.lib.sg_lean_source_hash.restype = ctypes.c_char_p
        self.abi = self.lib.sg_lean_abi_version()
        self.source = self.lib.sg_lean_source_hash().decode()

    def call(self, name, *args):
        err = ctypes.create_string_buffer(ERR_LEN)
        if getattr(self.lib, name)(*args, err, ERR_LEN) != 0:
            raise OSError(f"{name}: {err.value.decode('utf-8', 'replace')}")


def preload():
    """Imports the agent's modules and the data stack; returns the names of those imported.
    Threads are kept off (OpenBLAS, OpenMP, Arrow's jemalloc: the node's environment) so the
    zygote stays single-threaded."""
    import importlib

    for name in AGENT_MODULES:
        importlib.import_module(f"sandgate_agent.{name}")
    done = []
    for name in DATA_STACK:
        try:
            importlib.import_module(name)
            done.append(name)
        except Exception:  # an image without one of them is still a sandbox image
            pass
    if "matplotlib" in sys.modules:
        sys.modules["matplotlib"].use("Agg")
    return done


class Zygote:
    def __init__(self, sock, lib, archive_fd):
        self.sock = sock
        self.lib = lib
        self.archive_fd = archive_fd
        self.children = set()

    def send(self, obj):
        self.sock.sendall(json.dumps(obj, separators=(",", ":")).encode())

    def serve(self, modules):
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.send(
            {
                "op": "ready",
                "abi": self.lib.abi,
                "source": self.lib.source,
                "pid": os.getpid(),
                "threads": len(os.listdir("/proc/self/task")),
                "modules": modules,
            }
        )
        while True:
            ready, _, _ = select.select([self.sock, wake_r], [], [])
            if wake_r in ready:
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    pass
            self.reap()
            if self.sock not in ready:
                continue
            try:
                data, fds, _flags, _addr = socket.recv_fds(self.sock, MAX_MESSAGE, 8)
            except InterruptedError:
                continue
            if not data:
                for fd in fds:
                    os.close(fd)
                return  # the node is gone
            try:
                req = json.loads(data)
                op = req.get("op")
            except (ValueError, AttributeError):
                req, op = {}, None
            if op == "spawn":
                self.spawn(req, fds, wake_r, wake_w)
            else:
                for fd in fds:
                    os.close(fd)
                if op == "stats":
                    usage = resource.getrusage(resource.RUSAGE_SELF)
                    self.send(
                        {
                            "op": "stats",
                            "threads": len(os.listdir("/proc/self/task")),
                            "cpu_s": usage.ru_utime + usage.ru_stime,
                            "children": len(self.children),
                        }
                    )

    def reap(self):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.discard(pid)
            self.send({"op": "exited", "pid": pid, "code": os.waitstatus_to_exitcode(status)})

    def spawn(self, req, fds, wake_r, wake_w):
        sandbox_id = req.get("id")
        spec = req.get("spec")
        if len(fds) != 2 or not isinstance(spec, dict):
            for fd in fds:
                os.close(fd)
            self.send({"op": "refused", "id": sandbox_id, "error": "a spawn needs a spec and 2 descriptors"})
            return
        stdio, stderr_w = fds
        try:
            self.lib.call("sg_lean_before_fork")
        except OSError as err:
            os.close(stdio)
            os.close(stderr_w)
            self.send({"op": "refused", "id": sandbox_id, "error": str(err)})
            return
        try:
            pid = os.fork()
            if pid == 0:
                os.close(wake_r)
                os.close(wake_w)
                self.become_sandbox(stdio, stderr_w, spec)  # never returns
        finally:
            # Even if the fork failed: later children belong to the zygote's own pid namespace.
            self.lib.call("sg_lean_after_fork")
            os.close(stdio)
            os.close(stderr_w)
        self.children.add(pid)
        self.send({"op": "spawned", "id": sandbox_id, "pid": pid})

    def become_sandbox(self, stdio, stderr_w, spec):
        """In the child: builds the container (the library), then runs the agent. Never returns:
        a failure anywhere ends the process before any sandbox code could run."""
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.dup2(stdio, 0)
            os.dup2(stdio, 1)
            os.dup2(stderr_w, 2)
            os.close(stdio)
            os.close(stderr_w)
            self.sock.close()
            spec = dict(spec)
            spec["keep_fds"] = [self.archive_fd] if self.archive_fd is not None else []
            data = json.dumps(spec).encode()
            self.lib.call("sg_lean_enter", data, len(data))
        except BaseException as err:
            try:
                os.write(2, f"sandgate-zygote: the sandbox's container could not be built: {err}\n".encode())
            finally:
                os._exit(70)
        try:
            from . import lean, supervisor

            os.environ["HOME"] = config.HOME
            supervisor.main(archive_fd=self.archive_fd, forkserver=lean.KernelForkServer.start)
        except BaseException as err:
            try:
                os.write(2, f"sandgate-agent: fatal: {err!r}\n".encode())
            except OSError:
                pass
        os._exit(1)


def main(rt_ready=None, archive_fd=None):
    """The zygote role's start (main.py): loads the library, imports, serves the node."""
    sock_fd = int(os.environ.pop(ENV_SOCKET_FD))
    lib_fd = int(os.environ.pop(ENV_LIB_FD))
    lib = Library(lib_fd)
    os.close(lib_fd)
    lib.call("sg_lean_prepare")
    modules = preload()
    # Objects that exist now are never collected: a child's collections then never touch (and
    # copy) the pages they live on.
    gc.collect()
    gc.freeze()
    sock = socket.socket(fileno=sock_fd)
    sock.setblocking(True)
    Zygote(sock, lib, archive_fd).serve(modules)
    os._exit(0)
