"""Framing (protocol.py): bad frames, the end of the input, control ops beside a running cell."""

import base64
import uuid

from agent_harness import pids_with_mark, wait_until


def test_user_code_cannot_read_protocol_input(agent):
    result, _ = agent.run("import sys\ndata = sys.stdin.read()\nlen(data)")
    assert result["error"] is None, result
    assert result["result"]["text/plain"] == "0"
    assert agent.ok("ping")[1]["pong"] is True


def test_bad_frames_are_answered_and_ignored(agent):
    agent.send_raw(b"{not json\n")
    _, final = agent.wait(None)
    assert final == {
        "id": None,
        "ok": False,
        "error": {"kind": "bad_request", "message": final["error"]["message"]},
    }
    agent.send_raw(b"[1, 2]\n\xff\xfe\n")
    for _ in range(2):
        assert agent.wait(None)[1]["error"]["kind"] == "bad_request"
    agent.send({"id": 77, "op": "no_such_op"})
    assert agent.wait(77)[1]["error"]["kind"] == "bad_request"
    agent.send({"id": 78, "op": "exec"})
    assert agent.wait(78)[1]["error"]["kind"] == "bad_request"
    assert agent.ok("ping")[1]["pong"] is True
    result, _ = agent.run("1 + 1")
    assert result["result"]["text/plain"] == "2"


def test_agent_exits_on_stdin_eof(agent):
    mark = uuid.uuid4().hex
    agent.start(
        "command", command=f"export SANDGATE_TEST_MARK={mark}; sleep 1000", timeout_ms=100_000
    )
    wait_until(lambda: pids_with_mark(mark), 10, "command never started")
    agent.proc.stdin.close()
    agent.proc.wait(timeout=10)
    wait_until(lambda: not pids_with_mark(mark), 5, "command survived the agent")


def test_control_ops_are_answered_while_a_cell_runs(agent):
    (agent.home / "data.txt").write_text("payload")
    cell = agent.start("exec", code="import time\ntime.sleep(3)")
    agent.wait_busy()
    events, read = agent.ok("read_file", path="data.txt", max_bytes=1000)
    assert base64.b64decode(events[0]["data"]) == b"payload"
    _, listing = agent.ok("list_dir", path=".")
    assert "data.txt" in [e["name"] for e in listing["entries"]]
    _, cmd = agent.ok("command", command="echo concurrent", timeout_ms=10_000)
    assert cmd["exit_code"] == 0
    assert agent.poll_final(cell) is None, "the cell should still be running"
    _, final = agent.wait(cell)
    assert final["ok"]
    assert agent.ok("ping")[1]["busy"] is False


def test_frames_after_restart_are_not_lost(agent):
    # Written in one go: the agent has read the ping before it restarts.
    agent.send_raw(b'{"id": 500, "op": "restart"}\n{"id": 501, "op": "ping"}\n')
    _, final = agent.wait(501)
    assert final["ok"] and final["result"]["pong"]
    _, restarted = agent.wait(500, timeout=60)
    assert restarted["ok"], restarted
