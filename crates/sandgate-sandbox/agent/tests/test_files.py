"""Files (files.py): chunked uploads and downloads, listings, errors, paths confined to the home."""

import base64
import hashlib
import os

import pytest

from agent_harness import MIB


def write_file(agent, path, data, overwrite=False, chunk=256 * 1024):
    req_id = agent.start("write_file", path=path, overwrite=overwrite, size=len(data))
    pieces = [data[i : i + chunk] for i in range(0, len(data), chunk)] or [b""]
    for i, piece in enumerate(pieces):
        agent.send(
            {
                "id": req_id,
                "op": "chunk",
                "data": base64.b64encode(piece).decode(),
                "last": i == len(pieces) - 1,
            }
        )
    return agent.wait(req_id)[1]


def test_chunked_write_and_read_of_10_mib(agent):
    data = os.urandom(10 * MIB)
    digest = hashlib.sha256(data).hexdigest()
    final = write_file(agent, "deep/dir/blob.bin", data)
    assert final["ok"], final
    target = agent.home / "deep" / "dir" / "blob.bin"
    assert final["result"] == {"path": str(target), "size": len(data), "sha256": digest}
    assert sorted(os.listdir(target.parent)) == ["blob.bin"], "temporary file left behind"
    events, result = agent.ok("read_file", path="deep/dir/blob.bin", max_bytes=20 * MIB)
    chunks = [base64.b64decode(e["data"]) for e in events if e["event"] == "chunk"]
    assert all(len(c) <= 256 * 1024 for c in chunks)
    assert b"".join(chunks) == data
    assert {k: result[k] for k in ("path", "size", "sha256")} == {
        "path": str(target),
        "size": len(data),
        "sha256": digest,
    }
    assert result["space"]["total"] > 0 and result["space"]["free"] >= 0, result


def test_write_exists_and_overwrite(agent):
    assert write_file(agent, "f.txt", b"one")["ok"]
    refused = write_file(agent, "f.txt", b"two")
    assert refused["error"]["kind"] == "exists"
    assert (agent.home / "f.txt").read_bytes() == b"one"
    assert write_file(agent, "f.txt", b"three", overwrite=True)["ok"]
    assert (agent.home / "f.txt").read_bytes() == b"three"
    assert write_file(agent, "empty.txt", b"")["ok"]
    assert (agent.home / "empty.txt").read_bytes() == b""
    (agent.home / "adir").mkdir()
    assert write_file(agent, "adir", b"x", overwrite=True)["error"]["kind"] == "is_directory"
    assert agent.ok("ping")[1]["pong"], "stray chunks of refused writes must be ignored"


def test_failed_write_leaves_nothing_behind(agent):
    req_id = agent.start("write_file", path="partial.bin", overwrite=False, size=10)
    agent.send(
        {"id": req_id, "op": "chunk", "data": base64.b64encode(b"12345").decode(), "last": True}
    )
    final = agent.wait(req_id)[1]
    assert final["error"]["kind"] == "bad_request", final
    assert os.listdir(agent.home) == []


def test_read_file_errors(agent):
    (agent.home / "big.bin").write_bytes(b"x" * 1000)
    final = agent.call("read_file", path="big.bin", max_bytes=999)
    assert final[0] == [], "nothing may be sent before too_large"
    assert final[1]["error"]["kind"] == "too_large"
    assert "1000" in final[1]["error"]["message"] and "999" in final[1]["error"]["message"]
    assert agent.call("read_file", path="missing", max_bytes=10)[1]["error"]["kind"] == "not_found"
    (agent.home / "d").mkdir()
    assert agent.call("read_file", path="d", max_bytes=10)[1]["error"]["kind"] == "is_directory"


def test_list_dir(agent):
    (agent.home / "b.txt").write_bytes(b"12345")
    (agent.home / "a").mkdir()
    os.symlink("/etc", agent.home / "c-link")
    _, result = agent.ok("list_dir", path=".")
    assert result["path"] == str(agent.home)
    entries = [(e["name"], e["type"]) for e in result["entries"]]
    assert entries == [("a", "dir"), ("b.txt", "file"), ("c-link", "symlink")]
    assert result["entries"][1]["size"] == 5
    assert isinstance(result["entries"][1]["modified"], float)
    _, default = agent.ok("list_dir")
    assert default["path"] == str(agent.home)
    assert agent.call("list_dir", path="b.txt")[1]["error"]["kind"] == "not_a_directory"
    assert agent.call("list_dir", path="nope")[1]["error"]["kind"] == "not_found"


@pytest.mark.parametrize(
    "path, kind",
    [
        ("../etc/passwd", "outside_home"),
        ("/etc/passwd", "outside_home"),
        ("sub/../../x", "outside_home"),
        ("etc-link/passwd", "outside_home"),
        ("passwd-link", "outside_home"),
        ("a\x00b", "bad_request"),
    ],
)
def test_paths_outside_home_are_refused(agent, path, kind):
    os.symlink("/etc", agent.home / "etc-link")
    os.symlink("/etc/passwd", agent.home / "passwd-link")
    (agent.home / "sub").mkdir()
    assert agent.call("read_file", path=path, max_bytes=MIB)[1]["error"]["kind"] == kind
    assert agent.call("list_dir", path=path)[1]["error"]["kind"] == kind
    final = write_file(agent, path, b"x", overwrite=True)
    assert final["error"]["kind"] == kind
    assert (
        agent.call("command", command="true", cwd=path, timeout_ms=1000)[1]["error"]["kind"] == kind
    )


def test_write_through_symlinked_parent_is_refused(agent):
    outside = agent.home.parent / "outside"
    outside.mkdir()
    os.symlink(outside, agent.home / "escape")
    assert write_file(agent, "escape/new.txt", b"x")["error"]["kind"] == "outside_home"
    assert write_file(agent, "escape/deeper/new.txt", b"x")["error"]["kind"] == "outside_home"
    assert list(outside.iterdir()) == []


def test_absolute_path_inside_home_is_accepted(agent):
    final = write_file(agent, str(agent.home / "abs.txt"), b"abs")
    assert final["ok"] and final["result"]["path"] == str(agent.home / "abs.txt")
