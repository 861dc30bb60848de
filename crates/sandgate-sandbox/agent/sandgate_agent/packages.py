"""Packages (PROTOCOL.md, "index_serve"): the package index relay and the user site pip installs
into.

The sandbox has no network, but its pip is configured (/etc/pip.conf in the image) to use a package
index on loopback inside the container: this small HTTP server, run by the agent. It answers
nothing itself: each request pip makes becomes an `index_request` event of the gateway's open
`index_serve` call, and the gateway's answer (chunk frames with the same id) is streamed back to
pip. The gateway decides everything (policy, wheels only, hashes, its cache); the agent only
carries bytes. Installed packages go to PYTHONUSERBASE (a tmpfs of their own, outside the home).

http.server is imported where the agent starts the relay (IndexRelay.start), not here: the kernel
imports this module too (for `%pip`) and never serves the index, and the import (with email,
http.client, socketserver, mimetypes …) costs each process ~2.8 MB.
"""

import base64
import binascii
import collections
import importlib
import json
import os
import queue
import sys
import threading
import urllib.parse

from .config import (
    INDEX_FRAME_TIMEOUT_S,
    INDEX_MAX_NOTES,
    INDEX_MAX_PATH,
    INDEX_MAX_PENDING,
    INDEX_NOT_SERVING,
    INDEX_PATH,
    INDEX_PORT,
    INDEX_WANTED_WAIT_S,
    PACKAGES_BASE,
    WRITE_QUEUE_CHUNKS,
)


def user_site():
    """The site directory pip installs the sandbox user's packages into (PEP 370 user scheme)."""
    version = "%d.%d" % sys.version_info[:2]
    return os.path.join(PACKAGES_BASE, "lib", f"python{version}", "site-packages")


def prepare_user_site(rt):
    """Creates the user site directory before the kernel starts, so that Python puts it on sys.path
    at start-up (it is added only when it exists) and the next cell imports what pip installed."""
    if not os.path.isdir(PACKAGES_BASE):
        return
    try:
        rt.creds.run_as_user(os.makedirs, user_site(), 0o755, True)
    except OSError as err:
        rt.log(f"cannot create {user_site()}: {err}")


def register_pip_magic(shell, log):
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

    def __init__(self, rt):
        self.rt = rt
        self.writer = rt.writer
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
            self.rt.log(f"package index relay not started on 127.0.0.1:{INDEX_PORT}: {err}")
            return
        self.server.daemon_threads = True
        self.server.relay = self
        threading.Thread(target=self.server.serve_forever, name="index-relay", daemon=True).start()

    def port(self):
        """The port the relay listens on, None when it could not start."""
        return self.server.server_address[1] if self.server else None

    def serve(self, req_id):
        """A gateway call opens the relay; a newer call replaces an older one (answered at once)."""
        with self.lock:
            old, self.serving = self.serving, req_id
            self.served.notify_all()
        if old is not None:
            self.writer.ok(old, {"served": False, "replaced": True})

    def close(self, req_id):
        """Ends the open serve call `req_id` (the gateway's interrupt); False when not open."""
        with self.lock:
            if self.serving != req_id:
                return False
            self.serving = None
            pending = list(self.pending.values())
        for frames in pending:  # requests still waiting: the gateway will not answer them now
            frames.put({"closed": True})
        self.writer.ok(req_id, {"served": True, "replaced": False})
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
        """Keeps a note for the pip wrapper (what the gateway refused and why)."""
        with self.lock:
            self.note_seq += 1
            self.notes.append((self.note_seq, text[:2000]))

    def notes_after(self, seq):
        """The newest note's number and the texts of the notes after `seq`."""
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
        self.writer.event(call, "index_wanted")
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
        self.writer.event(serving, "index_request", rid=rid, path=path)
        return rid, frames

    def done(self, rid):
        """Forgets the relayed request `rid` (answered, or given up)."""
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
