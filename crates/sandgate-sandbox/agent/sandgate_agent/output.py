"""Output of a call (PROTOCOL.md, "Output"): the sink that turns bytes into stdout/stderr events
within the call's limit, and (in the kernel) the capture of fd 1 and 2 that feeds it."""

import codecs
import fcntl
import os
import select
import sys
import threading


class OutputSink:
    """Turns the raw output of one request (an exec or a command) into stdout/stderr events.

    It enforces the per-call output limit (stdout and stderr together) and emits the truncation
    marker once. Decoding is incremental per stream, so a UTF-8 sequence split across two reads is
    not mangled.
    """

    def __init__(self, writer, req_id, limit):
        self.writer = writer
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
            self.writer.event(
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
            self.writer.event(self.req_id, stream, data=text)


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
