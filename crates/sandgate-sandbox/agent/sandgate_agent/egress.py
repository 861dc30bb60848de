"""Egress (PROTOCOL.md, "egress_serve" and "egress_env"): the HTTP proxy on loopback inside the
container and the relay of its connections to the gateway.

The sandbox has no network interface. For a sandbox whose tenant has an egress policy, the gateway
sends `egress_env` and user processes get HTTPS_PROXY (and the other proxy variables) naming this
proxy. It understands `CONNECT host:port` only (what HTTPS clients send a proxy); each CONNECT
becomes a connection of the gateway's open `egress_serve` call: the agent says `egress_open`, the
gateway decides (its tenant's policy, the address checks) and answers `open` or `refused`, and then
bytes flow both ways as events and chunk frames. The agent decides nothing but carries bytes: a
rogue sandbox that talks to the relay directly gets no further than the gateway lets it.

A plain `http://` request through the proxy (absolute form) is refused with 403 and a text that
says why: only HTTPS is relayed for now.
"""

import base64
import binascii
import os
import queue
import socket
import tempfile
import threading

from .config import (
    EGRESS_CHUNK,
    EGRESS_IDLE_TIMEOUT_S,
    EGRESS_MAX_CAS,
    EGRESS_MAX_CONNECTIONS,
    EGRESS_MAX_HEAD,
    EGRESS_NOT_SERVING,
    EGRESS_OFF,
    EGRESS_OPEN_TIMEOUT_S,
    EGRESS_PLAIN_HTTP,
    EGRESS_PORT,
    EGRESS_ROUTE_WAIT_S,
    EGRESS_STATE_DIR,
    EGRESS_WANTED_WAIT_S,
    EGRESS_WINDOW_EVENTS,
    SYSTEM_CA_BUNDLES,
    WRITE_QUEUE_CHUNKS,
)

# The variables user processes get while egress is on. NO_PROXY keeps loopback direct (the
# package index relay on 127.0.0.1 is not reached through the proxy).
PROXY_VARIABLES = ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy")
NO_PROXY_VARIABLES = ("NO_PROXY", "no_proxy")
NO_PROXY = "localhost,127.0.0.1,::1"
# The CA bundle variables the common clients read (OpenSSL and so Python's ssl and urllib,
# requests, curl, Node): each names the bundle of the system's roots and this sandbox's egress CA.
CA_VARIABLES = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "NODE_EXTRA_CA_CERTS")
# Where the bundle is written (tmpfs; not under /home/user, so no download or archive holds it).
CA_BUNDLE = os.path.join(EGRESS_STATE_DIR, "ca-bundle.pem")
# Variables a secret's placeholder never replaces, whatever the gateway sends (the gateway refuses
# such names when a secret is set; this is the second guard).
RESERVED_NAMES = frozenset(
    PROXY_VARIABLES
    + NO_PROXY_VARIABLES
    + CA_VARIABLES
    + (
        "PATH", "HOME", "USER", "LOGNAME", "SHELL", "PWD", "OLDPWD", "TERM", "TMPDIR", "TZ",
        "LANG", "LANGUAGE", "SSL_CERT_DIR", "ALL_PROXY", "all_proxy", "MPLCONFIGDIR",
        "IPYTHONDIR", "HOSTNAME", "MPLBACKEND", "BASH_ENV", "ENV", "IFS", "PS4",
        "PROMPT_COMMAND", "GLIBC_TUNABLES", "GCONV_PATH", "HOSTALIASES", "SSLKEYLOGFILE",
        "CURL_HOME", "JAVA_TOOL_OPTIONS", "PERL5OPT", "PERL5LIB",
    )
)
RESERVED_PREFIXES = (
    "LC_", "LD_", "PYTHON", "SANDGATE", "PIP_", "JUPYTER", "NODE_", "OPENSSL", "GIT_", "XDG_",
)


def reserved(name):
    """Whether a placeholder may not take environment variable `name`."""
    return name in RESERVED_NAMES or name.startswith(RESERVED_PREFIXES)


def proxy_env(port):
    """The proxy variables for a proxy on 127.0.0.1:`port`."""
    url = f"http://127.0.0.1:{port}"
    env = {name: url for name in PROXY_VARIABLES}
    env.update({name: NO_PROXY for name in NO_PROXY_VARIABLES})
    return env


def fixed_env_names():
    """The variables `egress_env` sets or takes away besides the placeholders."""
    return list(PROXY_VARIABLES + NO_PROXY_VARIABLES + CA_VARIABLES)


def system_roots():
    """The system's CA bundle (Debian's ca-certificates), or "" where there is none."""
    for path in SYSTEM_CA_BUNDLES:
        try:
            with open(path, encoding="ascii", errors="replace") as f:
                return f.read()
        except OSError:
            continue
    return ""


def prepare_state_dir():
    """Makes the bundle's directory (in a container: root's, before any user code runs), so a
    user process cannot plant a directory or a link there first. Returns whether it is the
    agent's own: a real directory (not a link) owned by the agent's user."""
    try:
        os.makedirs(EGRESS_STATE_DIR, mode=0o755, exist_ok=True)
        fd = os.open(EGRESS_STATE_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            return False
        # Readable by user processes, which run under another uid than the agent's.
        os.fchmod(fd, 0o755)
        return True
    finally:
        os.close(fd)


def write_bundle(cas):
    """Writes the system's roots and `cas` (PEM texts) to CA_BUNDLE, replacing it whole (a client
    reading it meanwhile sees the old or the new one). Returns the path, or None when the
    directory is not the agent's own (see `prepare_state_dir`)."""
    if not prepare_state_dir():
        return None
    text = system_roots()
    if text and not text.endswith("\n"):
        text += "\n"
    for pem in cas:
        text += pem if pem.endswith("\n") else pem + "\n"
    fd, tmp = tempfile.mkstemp(dir=EGRESS_STATE_DIR, prefix=".bundle-")
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, CA_BUNDLE)
    return CA_BUNDLE


class EgressRelay:
    """The loopback proxy: relays each CONNECT over the gateway's `egress_serve` call."""

    def __init__(self, rt):
        self.rt = rt
        self.writer = rt.writer
        self.lock = threading.Lock()
        self.served = threading.Condition(self.lock)  # notified when a serve call opens
        self.serving = None  # request id of the open egress_serve call
        # Returns the id of a running exec or command (whose gateway call can open the relay on
        # demand), or None; set by the agent.
        self.call_for_egress = lambda: None
        self.conns = {}  # connection id -> queue of the gateway's frames for it
        self.socks = {}  # connection id -> the client's socket (ended when the relay gives up)
        # Whether the open serve call acknowledges data events (its `acks`); then connection id
        # -> its Credit.
        self.acks = False
        self.credits = {}
        self.next_cid = 1
        self.enabled = False  # set by egress_env: the tenant has an egress policy
        self.cas = []  # PEM texts of the egress CAs the gateway sent (egress_env), oldest first
        self.placeholders = {}  # secret name -> placeholder token (egress_env)
        self.bundle_ok = False  # the CA bundle was written where CA_VARIABLES point
        self.listener = None

    def start(self):
        prepare_state_dir()  # before any user code runs
        try:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", EGRESS_PORT))
            listener.listen(64)
        except OSError as err:
            self.rt.log(f"egress proxy not started on 127.0.0.1:{EGRESS_PORT}: {err}")
            return
        self.listener = listener
        threading.Thread(target=self.accept_loop, name="egress-proxy", daemon=True).start()

    def port(self):
        """The port the proxy listens on, None when it could not start."""
        return self.listener.getsockname()[1] if self.listener else None

    def env(self):
        """The variables user processes get now ({} while egress is off): the proxy's, the CA
        bundle's once the gateway sent a CA, and the secrets' placeholders."""
        with self.lock:
            on, cas, placeholders = self.enabled, list(self.cas), dict(self.placeholders)
        port = self.port()
        if not (on and port):
            return {}
        env = proxy_env(port)
        if cas and self.bundle_ok:
            env.update({name: CA_BUNDLE for name in CA_VARIABLES})
        env.update(placeholders)
        return env

    def set_enabled(self, on, ca_pem=None, placeholders=None):
        """Egress on or off; with `ca_pem` (a CA the gateway's egress component signs with) added
        to the bundle, and `placeholders` (name -> token) the secrets' variables from now on.
        Returns the names of the variables to take out of user processes."""
        ca_pem = ca_pem if isinstance(ca_pem, str) and "BEGIN CERTIFICATE" in ca_pem else None
        wanted = {
            name: token
            for name, token in (placeholders or {}).items()
            if isinstance(name, str) and isinstance(token, str) and not reserved(name)
        }
        with self.lock:
            self.enabled = bool(on)
            gone = set(self.placeholders) - set(wanted) if on else set(self.placeholders)
            self.placeholders = wanted if on else {}
            fresh = ca_pem is not None and ca_pem not in self.cas
            if fresh:
                # A few at most: one per gateway process that served this sandbox.
                self.cas = (self.cas + [ca_pem])[-EGRESS_MAX_CAS:]
            cas = list(self.cas)
        if on and (fresh or (cas and not os.path.exists(CA_BUNDLE))):
            try:
                written = write_bundle(cas) is not None
            except OSError as err:
                written = False
                self.rt.log(f"egress CA bundle not written: {err}")
            if not written:
                self.rt.log(f"egress CA bundle not written: {EGRESS_STATE_DIR} is not the agent's")
            with self.lock:
                self.bundle_ok = written
        return sorted(gone)

    def accept_loop(self):
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            try:
                threading.Thread(
                    target=self.handle, args=(sock,), name="egress-conn", daemon=True
                ).start()
            except RuntimeError:  # at the process limit: this connection is refused
                sock.close()

    def serve(self, req_id, acks=False):
        """A gateway call opens the relay; a newer call replaces an older one (answered at once,
        its connections closed). With `acks`, the gateway acknowledges each data event once it
        wrote it on, and each connection keeps at most EGRESS_WINDOW_EVENTS unacknowledged."""
        with self.lock:
            old, self.serving = self.serving, req_id
            self.acks = bool(acks)
            stale = list(self.conns.values()) if old is not None else []
            stale_socks = list(self.socks.values()) if old is not None else []
            if old is not None:
                self.conns.clear()
                self.socks.clear()
                self.end_credits()
            self.served.notify_all()
        for frames in stale:
            put_closed(frames)
        for sock in stale_socks:
            shutdown(sock, socket.SHUT_RDWR)
        if old is not None:
            self.writer.ok(old, {"served": False, "replaced": True})

    def close(self, req_id):
        """Ends the open serve call `req_id` (the gateway's interrupt); False when not open. Its
        connections end."""
        with self.lock:
            if self.serving != req_id:
                return False
            self.serving = None
            pending = list(self.conns.values())
            socks = list(self.socks.values())
            self.conns.clear()
            self.socks.clear()
            self.end_credits()
        for frames in pending:
            put_closed(frames)
        # A tunnel whose queue is full never reads the closing frame: its socket ends it.
        for sock in socks:
            shutdown(sock, socket.SHUT_RDWR)
        self.writer.ok(req_id, {"served": True, "replaced": False})
        return True

    def end_credits(self):
        """Ends every connection's credit (under the lock): their readers stop waiting."""
        for credit in self.credits.values():
            credit.end()
        self.credits.clear()

    def route(self, req_id, frame):
        """Takes a chunk frame of the serve call; True when it was one (even if now unwanted)."""
        with self.lock:
            if req_id is None or req_id != self.serving:
                return False
            if "ack" in frame:
                credit = self.credits.get(frame.get("cid"))
                if credit is not None:
                    credit.acked()
                return True
            frames = self.conns.get(frame.get("cid"))
        if frames is not None:
            try:
                # On the agent's reader thread: a client that reads nothing must not hold up
                # every other frame, so the wait is short.
                frames.put(frame, timeout=EGRESS_ROUTE_WAIT_S)
            except queue.Full:  # the client reads nothing: its connection is given up
                self.give_up(frame.get("cid"), req_id)
        return True

    def give_up(self, cid, serving):
        """Ends connection `cid`: its client's socket is shut (its threads end) and the gateway
        is told (`egress_close`), so neither side waits for it."""
        with self.lock:
            self.conns.pop(cid, None)
            sock = self.socks.pop(cid, None)
            credit = self.credits.pop(cid, None)
        if credit is not None:
            credit.end()
        if sock is not None:
            shutdown(sock, socket.SHUT_RDWR)
        self.writer.event(serving, "egress_close", cid=cid)

    def ask_for_serving(self):
        """Has the gateway open the relay on demand (an `egress_wanted` event on a running exec or
        command); True once it is open. Without a running call nobody can be asked."""
        with self.lock:
            if self.serving is not None:
                return True
        call = self.call_for_egress()
        if call is None:
            return False
        self.writer.event(call, "egress_wanted")
        with self.lock:
            return self.served.wait_for(lambda: self.serving is not None, EGRESS_WANTED_WAIT_S)

    def open(self, authority, sock=None):
        """Asks the gateway for a connection to `authority`; (cid, serve id, frames) or (None,
        None, (status, text)) when it cannot be asked."""
        if not self.ask_for_serving():
            return None, None, (503, EGRESS_NOT_SERVING)
        with self.lock:
            if self.serving is None:
                return None, None, (503, EGRESS_NOT_SERVING)
            if len(self.conns) >= EGRESS_MAX_CONNECTIONS:
                return None, None, (503, "too many egress connections at once")
            cid = self.next_cid
            self.next_cid += 1
            frames = queue.Queue(maxsize=WRITE_QUEUE_CHUNKS)
            self.conns[cid] = frames
            if sock is not None:
                self.socks[cid] = sock
            serving = self.serving
            acks = self.acks
            if acks:
                self.credits[cid] = Credit()
        if acks:
            self.writer.event(serving, "egress_open", cid=cid, authority=authority, acks=True)
        else:
            self.writer.event(serving, "egress_open", cid=cid, authority=authority)
        return cid, serving, frames

    def forget(self, cid):
        with self.lock:
            self.conns.pop(cid, None)
            self.socks.pop(cid, None)
            credit = self.credits.pop(cid, None)
        if credit is not None:
            credit.end()

    def handle(self, sock):
        """One client connection: its request head, then (for an admitted CONNECT) the tunnel."""
        try:
            sock.settimeout(EGRESS_IDLE_TIMEOUT_S)
            head = read_head(sock)
            if head is None:
                return
            method, target = parse_request_line(head)
            if method is None:
                answer(sock, 400, "not an HTTP request")
                return
            if method != "CONNECT":
                answer(sock, 403, EGRESS_PLAIN_HTTP)
                return
            with self.lock:
                enabled = self.enabled
            if not enabled:
                answer(sock, 403, EGRESS_OFF)
                return
            cid, serving, frames = self.open(target, sock)
            if cid is None:
                answer(sock, *frames)
                return
            try:
                Tunnel(self, sock, cid, serving, frames).run()
            finally:
                self.forget(cid)
        except OSError:
            pass  # the client went away
        finally:
            try:
                sock.close()
            except OSError:
                pass


class Tunnel:
    """An admitted CONNECT: the gateway's answer, then bytes both ways until both sides end."""

    def __init__(self, relay, sock, cid, serving, frames):
        self.relay = relay
        self.writer = relay.writer
        self.sock = sock
        self.cid = cid
        self.serving = serving
        self.frames = frames
        self.closed = threading.Event()  # the gateway ended the connection (or the relay closed)
        with relay.lock:
            self.credit = relay.credits.get(cid)  # None: the serve call acknowledges nothing

    def run(self):
        first = self.next_frame(EGRESS_OPEN_TIMEOUT_S)
        if first is None or first.get("closed"):
            answer(self.sock, 504, "the gateway did not answer this CONNECT")
            return
        if not first.get("open"):
            status = first.get("status")
            status = status if isinstance(status, int) and 400 <= status < 600 else 403
            answer(self.sock, status, str(first.get("refused") or "refused by the gateway"))
            return
        self.sock.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        down = threading.Thread(target=self.downstream, name="egress-down", daemon=True)
        down.start()
        self.upstream()
        down.join()

    def next_frame(self, timeout):
        try:
            return self.frames.get(timeout=timeout)
        except queue.Empty:
            return None

    def upstream(self):
        """Client to gateway: `egress_data` events, then `egress_eof` (or `egress_close` when the
        client broke off)."""
        while not self.closed.is_set():
            if self.credit is not None and not self.credit.take(EGRESS_IDLE_TIMEOUT_S):
                # Ended, or the gateway wrote nothing on for the idle timeout: the server is
                # not reading.
                if not self.closed.is_set():
                    self.writer.event(self.serving, "egress_close", cid=self.cid)
                    self.closed.set()
                    shutdown(self.sock, socket.SHUT_RDWR)
                return
            try:
                data = self.sock.recv(EGRESS_CHUNK)
            except (OSError, ValueError):
                if not self.closed.is_set():
                    self.writer.event(self.serving, "egress_close", cid=self.cid)
                return
            if self.closed.is_set():
                return  # the gateway ended it (its shutdown woke this read)
            if not data:
                self.writer.event(self.serving, "egress_eof", cid=self.cid)
                return
            if self.credit is not None:
                self.credit.spent()
            self.writer.event(
                self.serving, "egress_data", cid=self.cid, data=base64.b64encode(data).decode()
            )

    def downstream(self):
        """Gateway to client: chunk frames with data, then `eof` (or `closed`)."""
        while True:
            frame = self.next_frame(EGRESS_IDLE_TIMEOUT_S)
            if frame is None or frame.get("closed"):
                self.closed.set()
                if self.credit is not None:
                    self.credit.end()
                shutdown(self.sock, socket.SHUT_RDWR)
                return
            data = frame.get("data") or ""
            try:
                raw = base64.b64decode(data, validate=True) if data else b""
                if raw:
                    self.sock.sendall(raw)
            except (binascii.Error, TypeError, ValueError, OSError):
                self.closed.set()
                self.writer.event(self.serving, "egress_close", cid=self.cid)
                shutdown(self.sock, socket.SHUT_RDWR)
                return
            if frame.get("eof"):
                shutdown(self.sock, socket.SHUT_WR)
                return


class Credit:
    """How many of one connection's data events the gateway has not yet acknowledged."""

    def __init__(self):
        self.cond = threading.Condition()
        self.unacked = 0
        self.ended = False

    def take(self, timeout):
        """Waits for room for one more data event; False when the connection ended, or no room
        came within `timeout` seconds."""
        with self.cond:
            room = self.cond.wait_for(
                lambda: self.ended or self.unacked < EGRESS_WINDOW_EVENTS, timeout
            )
            return room and not self.ended

    def spent(self):
        with self.cond:
            self.unacked += 1

    def acked(self):
        with self.cond:
            self.unacked = max(0, self.unacked - 1)
            self.cond.notify_all()

    def end(self):
        with self.cond:
            self.ended = True
            self.cond.notify_all()


def put_closed(frames):
    try:
        frames.put_nowait({"closed": True})
    except queue.Full:
        pass


def shutdown(sock, how):
    try:
        sock.shutdown(how)
    except OSError:
        pass


def read_head(sock):
    """The request head (up to the blank line), None when the client sent none or too much."""
    data = b""
    while b"\r\n\r\n" not in data:
        if len(data) > EGRESS_MAX_HEAD:
            answer(sock, 431, "request head too large")
            return None
        chunk = sock.recv(4096)
        if not chunk:
            return None
        data += chunk
    # A client sends nothing after the head of a CONNECT before it hears 200: what follows (if
    # anything) is dropped.
    return data.split(b"\r\n\r\n", 1)[0].decode("latin-1")


def parse_request_line(head):
    """(method, target) of the head's first line; (None, None) when it is not one."""
    parts = head.split("\r\n", 1)[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        return None, None
    return parts[0].upper(), parts[1]


def answer(sock, status, text):
    """A short plain-text answer; its first line is the reason phrase too (curl shows it)."""
    body = (text + "\n").encode("utf-8")
    reason = text.splitlines()[0][:200].encode("ascii", "replace").decode() if text else "Error"
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    try:
        sock.sendall(head.encode("latin-1") + body)
    except OSError:
        pass
