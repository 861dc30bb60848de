"""The package index relay (packages.py; PROTOCOL.md, index_serve)."""

import base64
import json
import threading
import uuid

from agent_harness import pids_with_mark, text, wait_until


def test_the_kernel_does_not_load_the_package_index_relays_http_server(agent):
    # Only the agent serves the index; in the kernel (the same source) http.server and what it
    # pulls in (email, http.client, mimetypes) would cost ~2 MB for nothing.
    result, _ = agent.run("import sys\nsorted(m for m in ('http.server', 'email') if m in sys.modules)")
    assert result["result"]["text/plain"] == "[]", result


def relay_get(agent, path, timeout=90):
    """GET on the agent's loopback index; (status, reason, body)."""
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", agent.ready["index_port"], timeout=timeout)
    try:
        conn.request("GET", path)
        answer = conn.getresponse()
        return answer.status, answer.reason, answer.read()
    finally:
        conn.close()


def open_index_serve(agent):
    """Opens an `index_serve` call and returns its id once the relay is open. The agent opens it
    when its reader thread takes the frame, which pip's request (another thread) could overtake:
    without a running call to ask, that request hears 503 at once. The reader handles frames in
    order, so the answer to a ping sent behind it means the serve call is open."""
    serve = agent.start("index_serve")
    agent.ok("ping")
    return serve


def test_the_index_relay_forwards_pip_requests_to_the_open_serve_call(agent):
    assert isinstance(agent.ready["index_port"], int), agent.ready
    serve = open_index_serve(agent)
    got = {}

    def fetch():
        got["answer"] = relay_get(agent, "/simple/sgdemo/")

    client = threading.Thread(target=fetch)
    client.start()
    q = agent._queue(serve)
    request = q.get(timeout=90)
    assert request["event"] == "index_request" and request["path"] == "/simple/sgdemo/", request
    body = b'{"files": []}'
    half = len(body) // 2
    for data, last, first in ((body[:half], False, True), (body[half:], True, False)):
        frame = {"id": serve, "op": "chunk", "rid": request["rid"], "last": last}
        frame["data"] = base64.b64encode(data).decode()
        if first:
            frame.update(status=200, content_type="application/vnd.pypi.simple.v1+json", length=len(body))
        agent.send(frame)
    client.join(90)
    assert got.get("answer") == (200, "OK", body), got

    # Closing the serve call (the gateway's interrupt) answers it; pip then hears 503.
    _, interrupted = agent.ok("interrupt", target=serve)
    assert interrupted == {"interrupted": True}
    _, final = agent.wait(serve)
    assert final["ok"] and final["result"]["served"] is True, final
    status, reason, text = relay_get(agent, "/simple/sgdemo/")
    assert status == 503 and b"only inside a call" in text, (status, reason, text)
    # The refusal is kept as a note for the pip wrapper.
    _, _, notes = relay_get(agent, "/_sandgate/notes?after=0")
    assert any("only inside a call" in n for n in json.loads(notes)["notes"]), notes


def test_pip_asks_a_running_call_to_open_the_relay_on_demand(agent):
    """The gateway opens no relay beside a call up front: pip's first request makes the agent send
    `index_wanted` on a running call, and the request goes through once a serve call opens."""
    mark = uuid.uuid4().hex
    cmd = agent.start(
        "command", command=f"export SANDGATE_TEST_MARK={mark}; sleep 1000", timeout_ms=100_000
    )
    wait_until(lambda: pids_with_mark(mark), 10, "command never started")
    got = {}

    def fetch():
        got["answer"] = relay_get(agent, "/simple/sgdemo/")

    client = threading.Thread(target=fetch)
    client.start()
    wanted = agent._queue(cmd).get(timeout=30)
    assert wanted == {"id": cmd, "event": "index_wanted"}, wanted
    serve = agent.start("index_serve")
    request = agent._queue(serve).get(timeout=30)
    assert request["event"] == "index_request" and request["path"] == "/simple/sgdemo/", request
    body = b"ok"
    agent.send(
        {"id": serve, "op": "chunk", "rid": request["rid"], "last": True, "status": 200,
         "content_type": "text/plain", "length": len(body), "data": base64.b64encode(body).decode()}
    )
    client.join(30)
    assert got.get("answer") == (200, "OK", body), got
    agent.ok("interrupt", target=serve)
    agent.ok("interrupt", target=cmd)
    agent.wait(cmd)


def test_pip_without_a_running_call_hears_503_at_once(agent):
    """Nobody to ask (pip in a background job between calls): refused without waiting."""
    status, _, text = relay_get(agent, "/simple/sgdemo/", timeout=5)
    assert status == 503 and b"only inside a call" in text, (status, text)


def test_the_index_relay_forwards_nothing_but_index_paths(agent):
    serve = open_index_serve(agent)
    for path in ("/etc/passwd", "/simple/../../x/", "/files/abc/x.whl", "/simple/a%20b/", "/" + "a" * 3000):
        status, _, _ = relay_get(agent, path)
        assert status == 404, path
    # Nothing reached the gateway.
    assert agent._queue(serve).empty()
    agent.ok("interrupt", target=serve)
