"""Frames in and out (PROTOCOL.md, "Framing"): the writer every part sends frames with, the error a
request fails with, and the reader that calls `op_<name>` for each request."""

import json
import os
import threading
import traceback

from .config import AT_PROCESS_LIMIT, MAX_FRAME_BYTES


class ProtocolWriter:
    """Writes frames to a private descriptor (the agent: the container's stdout; the kernel: its
    pipe to the agent).

    Many threads emit frames, so one lock serialises them, and each frame is written as one complete
    line with a single write call (looping only if the kernel accepts part of it), so frames never
    interleave.
    """

    def __init__(self, fd, rt):
        self.fd = fd
        self.rt = rt
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
                self.rt.log(f"protocol output failed ({err}); exiting")
                self.rt.shutdown(1)

    def ok(self, req_id, result):
        self.send({"id": req_id, "ok": True, "result": result})

    def error(self, req_id, kind, message):
        self.send({"id": req_id, "ok": False, "error": {"kind": kind, "message": message}})

    def event(self, req_id, event, **fields):
        frame = {"id": req_id, "event": event}
        frame.update(fields)
        self.send(frame)



class OpError(Exception):
    """A request failed; becomes an `{"ok": false, "error": {kind, message}}` final frame."""

    def __init__(self, kind, message):
        super().__init__(message)
        self.kind = kind
        self.message = message




class FrameServer:
    """Reads newline-delimited JSON requests from a descriptor and calls `op_<name>` for each."""

    def __init__(self, rt, proto_in):
        self.rt = rt
        self.writer = rt.writer
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
                self.rt.log(f"frame handling failed: {traceback.format_exc()}")
                self.writer.error(None, "internal", f"agent error: {err!r}")
        # Protocol input closed: the other side is gone for good (PROTOCOL.md: exit on EOF).
        self.rt.shutdown(0)

    def handle_line(self, line):
        if line is None:
            self.writer.error(None, "bad_request", f"frame longer than {MAX_FRAME_BYTES} bytes")
            return
        if not line.strip():
            return
        try:
            frame = json.loads(line)
        except ValueError as err:  # also UnicodeDecodeError
            self.writer.error(None, "bad_request", f"frame is not valid JSON: {err}")
            return
        if not isinstance(frame, dict):
            self.writer.error(None, "bad_request", "frame is not a JSON object")
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
            handler = self.handler(op) if isinstance(op, str) else None
            if handler is None:
                raise OpError("bad_request", f"unknown op {op!r}")
            self.dispatch_op(op, handler, req_id, frame)
        except OpError as err:
            self.writer.error(req_id, err.kind, err.message)
        except Exception as err:  # an agent bug: this request fails, the agent lives on
            self.rt.log(f"{op} failed: {traceback.format_exc()}")
            self.writer.error(req_id, "internal", f"agent error: {err!r}")

    def handler(self, op):
        """The function that answers `op`, None for an unknown op."""
        return getattr(self, f"op_{op}", None)

    def dispatch_op(self, op, handler, req_id, frame):
        handler(req_id, frame)

    def route_chunk(self, req_id, frame):
        pass

    def spawn(self, name, target, req_id, *args, as_user=False):
        """Runs a request on its own thread; its OpError or crash becomes the final frame."""

        def run():
            try:
                if as_user:
                    self.rt.creds.run_as_user(target, req_id, *args)
                else:
                    target(req_id, *args)
            except OpError as err:
                self.writer.error(req_id, err.kind, err.message)
            except Exception as err:
                self.rt.log(f"{name} failed: {traceback.format_exc()}")
                self.writer.error(req_id, "internal", f"agent error: {err!r}")

        try:
            threading.Thread(target=run, name=f"{name}-{req_id}", daemon=True).start()
        except RuntimeError:
            raise OpError("limit", AT_PROCESS_LIMIT + ": this request cannot start now") from None


def int_arg(frame, name, default):
    """The non-negative integer argument `name` of a request, `default` when absent."""
    value = frame.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise OpError("bad_request", f"{name} must be a non-negative integer")
    return value
