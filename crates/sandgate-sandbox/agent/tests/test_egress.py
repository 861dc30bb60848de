"""The egress proxy and relay (egress.py; PROTOCOL.md, egress_env and egress_serve)."""

import base64
import socket
import uuid

from agent_harness import pids_with_mark, wait_until


def proxy(agent, timeout=30):
    """A connection to the agent's loopback proxy."""
    sock = socket.create_connection(("127.0.0.1", agent.ready["egress_port"]), timeout=timeout)
    return sock


def read_head(sock):
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head.decode("latin-1"), rest


def read_all(sock):
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk


def connect(agent, authority):
    sock = proxy(agent)
    sock.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    return sock


def open_serve(agent):
    """An open egress_serve call (the ping behind it means the reader took it)."""
    serve = agent.start("egress_serve")
    agent.ok("ping")
    return serve


def chunk(agent, serve, cid, **fields):
    agent.send({"id": serve, "op": "chunk", "cid": cid, **fields})


def printed(agent, code):
    """What a cell printed."""
    result, events = agent.run(code)
    assert result.get("error") is None, result
    return "".join(e["data"] for e in events if e["event"] == "stdout").strip()


def b64(data):
    return base64.b64encode(data).decode()


def test_without_egress_env_a_connect_is_refused_by_the_agent_itself(agent):
    assert isinstance(agent.ready["egress_port"], int), agent.ready
    serve = open_serve(agent)
    sock = connect(agent, "api.shop.example:443")
    head, body = read_head(sock)
    body += read_all(sock)
    assert head.startswith("HTTP/1.1 403 "), head
    assert b"no egress policy" in body, body
    # Nothing reached the gateway.
    assert agent._queue(serve).empty()
    agent.ok("interrupt", target=serve)


def test_egress_env_sets_the_proxy_variables_of_the_kernel_and_commands_and_takes_them_out(agent):
    port = agent.ready["egress_port"]
    assert printed(agent, "import os\nprint(os.environ.get('HTTPS_PROXY'))") == "None"
    _, answer = agent.ok("egress_env", proxy=True)
    assert answer["proxy"] is True and answer["kernel_applied"] is True, answer
    want = f"http://127.0.0.1:{port}"
    got = printed(agent, "import os\nprint(os.environ['HTTPS_PROXY'], os.environ['http_proxy'], os.environ['NO_PROXY'])")
    assert got == f"{want} {want} localhost,127.0.0.1,::1", got
    events, final = agent.call("command", command="echo $HTTPS_PROXY $no_proxy", timeout_ms=10_000)
    out = "".join(e["data"] for e in events if e["event"] == "stdout")
    assert out.strip() == f"{want} localhost,127.0.0.1,::1", (out, final)
    # A restarted kernel is a new process: it gets them at its start.
    agent.ok("restart", timeout=120)
    assert printed(agent, "import os\nprint(os.environ.get('HTTPS_PROXY'))") == want

    _, answer = agent.ok("egress_env", proxy=False)
    assert answer["proxy"] is False, answer
    assert printed(agent, "import os\nprint([k for k in os.environ if 'proxy' in k.lower()])") == "[]"
    events, _ = agent.call("command", command="env | cut -d= -f1 | grep -ci proxy || true", timeout_ms=10_000)
    assert "".join(e["data"] for e in events if e["event"] == "stdout").strip() == "0"


CA_PEM = "-----BEGIN CERTIFICATE-----\nTUlJQnRoaXMtaXMtYS10ZXN0\n-----END CERTIFICATE-----\n"


def test_egress_env_brings_the_ca_bundle_and_the_placeholders_and_takes_them_out(agent):
    _, answer = agent.ok(
        "egress_env",
        proxy=True,
        ca_pem=CA_PEM,
        placeholders={"SHOP_TOKEN": "sgp_shop_1234", "PATH": "sgp_evil", "LD_PRELOAD": "sgp_evil"},
    )
    assert answer["kernel_applied"] is True and answer["placeholders"] == ["SHOP_TOKEN"], answer
    got = printed(
        agent,
        "import os\nprint(os.environ['SHOP_TOKEN'], os.environ['SSL_CERT_FILE'] == os.environ['REQUESTS_CA_BUNDLE'] == os.environ['NODE_EXTRA_CA_CERTS'], os.environ.get('LD_PRELOAD'), 'sgp' in os.environ['PATH'])",
    )
    assert got == "sgp_shop_1234 True None False", got
    bundle = printed(agent, "import os\nprint(open(os.environ['SSL_CERT_FILE']).read())")
    assert CA_PEM.strip() in bundle, bundle
    # The system's roots stay trusted beside it (where the host has a bundle).
    import os.path
    if os.path.exists("/etc/ssl/certs/ca-certificates.crt"):
        assert bundle.count("BEGIN CERTIFICATE") > 10, bundle[:200]
    events, _ = agent.call("command", command="echo $SHOP_TOKEN $CURL_CA_BUNDLE", timeout_ms=10_000)
    out = "".join(e["data"] for e in events if e["event"] == "stdout").split()
    assert out[0] == "sgp_shop_1234" and out[1].endswith("ca-bundle.pem"), out

    # A second CA (another gateway process) joins the first; a secret taken out leaves.
    second = CA_PEM.replace("YS10ZXN0", "c2Vjb25k")
    _, answer = agent.ok("egress_env", proxy=True, ca_pem=second, placeholders={})
    assert answer["placeholders"] == [], answer
    got = printed(agent, "import os\nb = open(os.environ['SSL_CERT_FILE']).read()\nprint(os.environ.get('SHOP_TOKEN'), 'c2Vjb25k' in b, 'YS10ZXN0' in b)")
    assert got == "None True True", got

    # Off: every variable leaves, the bundle's too.
    agent.ok("egress_env", proxy=False)
    got = printed(agent, "import os\nprint([k for k in os.environ if k in ('SSL_CERT_FILE', 'SHOP_TOKEN', 'CURL_CA_BUNDLE')])")
    assert got == "[]", got


def test_egress_env_refuses_a_bad_ca_or_placeholders(agent):
    for fields, word in (({"ca_pem": 3}, "ca_pem"), ({"placeholders": ["A"]}, "placeholders")):
        _, final = agent.call("egress_env", proxy=True, **fields)
        assert not final["ok"] and final["error"]["kind"] == "bad_request", final
        assert word in final["error"]["message"], final


def test_plain_http_through_the_proxy_is_refused_with_a_clear_text(agent):
    agent.ok("egress_env", proxy=True)
    sock = proxy(agent)
    sock.sendall(b"GET http://api.shop.example/ HTTP/1.1\r\nHost: api.shop.example\r\n\r\n")
    head, body = read_head(sock)
    body += read_all(sock)
    assert head.startswith("HTTP/1.1 403 "), head
    assert b"HTTPS only" in body, body
    sock = proxy(agent)
    sock.sendall(b"not http at all\r\n\r\n")
    head, _ = read_head(sock)
    assert head.startswith("HTTP/1.1 400 "), head


def test_a_connect_without_a_running_call_hears_503_at_once(agent):
    agent.ok("egress_env", proxy=True)
    sock = connect(agent, "api.shop.example:443")
    head, body = read_head(sock)
    body += read_all(sock)
    assert head.startswith("HTTP/1.1 503 ") and b"only inside a call" in body, (head, body)


def test_a_connect_is_relayed_both_ways_over_the_serve_call(agent):
    agent.ok("egress_env", proxy=True)
    serve = open_serve(agent)
    q = agent._queue(serve)
    sock = connect(agent, "api.shop.example:443")
    opened = q.get(timeout=30)
    assert opened["event"] == "egress_open" and opened["authority"] == "api.shop.example:443", opened
    cid = opened["cid"]
    chunk(agent, serve, cid, open=True)
    head, rest = read_head(sock)
    assert head == "HTTP/1.1 200 Connection established" and rest == b"", head
    sock.sendall(b"hello upstream")
    got = b""
    while got != b"hello upstream":
        frame = q.get(timeout=30)
        assert frame["event"] == "egress_data" and frame["cid"] == cid, frame
        got += base64.b64decode(frame["data"])
    chunk(agent, serve, cid, data=b64(b"hello "))
    chunk(agent, serve, cid, data=b64(b"sandbox"), eof=True)
    assert read_all(sock) == b"hello sandbox"
    sock.shutdown(socket.SHUT_WR)
    frame = q.get(timeout=30)
    assert frame == {"id": serve, "event": "egress_eof", "cid": cid}, frame
    sock.close()
    agent.ok("interrupt", target=serve)


def test_a_client_that_reads_nothing_is_given_up_without_holding_up_the_agent(agent):
    agent.ok("egress_env", proxy=True)
    serve = open_serve(agent)
    q = agent._queue(serve)
    sock = connect(agent, "api.shop.example:443")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    opened = q.get(timeout=30)
    cid = opened["cid"]
    chunk(agent, serve, cid, open=True)
    # The gateway keeps sending, the client never reads: the socket buffers fill, then the
    # connection's queue, and the agent gives the connection up and says so.
    big = b64(b"x" * 65536)
    for _ in range(200):
        chunk(agent, serve, cid, data=big)
    closed = None
    while closed is None:
        frame = q.get(timeout=60)
        if frame.get("event") == "egress_close" and frame.get("cid") == cid:
            closed = frame
    # The reader stayed responsive: a ping is answered at once.
    _, pong = agent.ok("ping", timeout=10)
    assert pong["pong"] is True, pong
    sock.close()
    agent.ok("interrupt", target=serve)


def test_a_refusal_reaches_the_client_with_the_gateways_text(agent):
    agent.ok("egress_env", proxy=True)
    serve = open_serve(agent)
    sock = connect(agent, "evil.example:443")
    opened = agent._queue(serve).get(timeout=30)
    text = "evil.example:443 is not in this tenant's egress policy"
    chunk(agent, serve, opened["cid"], refused=text, status=403)
    head, body = read_head(sock)
    body += read_all(sock)
    assert head.startswith("HTTP/1.1 403 evil.example:443 is not"), head
    assert text.encode() in body, body
    agent.ok("interrupt", target=serve)


def test_closing_the_serve_call_ends_its_connections(agent):
    agent.ok("egress_env", proxy=True)
    serve = open_serve(agent)
    sock = connect(agent, "api.shop.example:443")
    opened = agent._queue(serve).get(timeout=30)
    chunk(agent, serve, opened["cid"], open=True)
    head, _ = read_head(sock)
    assert head.startswith("HTTP/1.1 200"), head
    _, interrupted = agent.ok("interrupt", target=serve)
    assert interrupted == {"interrupted": True}
    assert read_all(sock) == b""


def test_a_connect_asks_a_running_call_to_open_the_relay(agent):
    agent.ok("egress_env", proxy=True)
    mark = uuid.uuid4().hex
    cmd = agent.start(
        "command", command=f"export SANDGATE_TEST_MARK={mark}; sleep 1000", timeout_ms=100_000
    )
    wait_until(lambda: pids_with_mark(mark), 10, "command never started")
    sock = connect(agent, "api.shop.example:443")
    wanted = agent._queue(cmd).get(timeout=30)
    assert wanted == {"id": cmd, "event": "egress_wanted"}, wanted
    serve = agent.start("egress_serve")
    opened = agent._queue(serve).get(timeout=30)
    assert opened["event"] == "egress_open", opened
    chunk(agent, serve, opened["cid"], refused="no", status=403)
    head, _ = read_head(sock)
    assert head.startswith("HTTP/1.1 403"), head
    agent.ok("interrupt", target=serve)
    agent.ok("interrupt", target=cmd)
    agent.wait(cmd)


def test_with_acks_a_connection_stays_within_its_window_of_unacknowledged_data(agent):
    import queue
    import threading

    agent.ok("egress_env", proxy=True)
    serve = agent.start("egress_serve", acks=True)
    agent.ok("ping")
    q = agent._queue(serve)
    sock = connect(agent, "api.shop.example:443")
    opened = q.get(timeout=30)
    assert opened["event"] == "egress_open" and opened["acks"] is True, opened
    cid = opened["cid"]
    chunk(agent, serve, cid, open=True)
    head, _ = read_head(sock)
    assert head.startswith("HTTP/1.1 200"), head
    # The client sends far more than the window and the gateway acknowledges nothing: 16 data
    # events, then the agent stops reading the client.
    def push():
        try:
            sock.sendall(b"u" * (8 << 20))
        except OSError:
            pass  # closed at the test's end

    threading.Thread(target=push, daemon=True).start()
    for _ in range(16):
        frame = q.get(timeout=30)
        assert frame["event"] == "egress_data" and frame["cid"] == cid, frame
    try:
        extra = q.get(timeout=2)
    except queue.Empty:
        extra = None
    assert extra is None, f"a 17th event without an acknowledgement: {extra}"
    # Each acknowledgement lets one more through; the reader stayed responsive meanwhile.
    _, pong = agent.ok("ping", timeout=10)
    assert pong["pong"] is True, pong
    chunk(agent, serve, cid, ack=65536)
    frame = q.get(timeout=30)
    assert frame["event"] == "egress_data" and frame["cid"] == cid, frame
    sock.close()
    agent.ok("interrupt", target=serve)
