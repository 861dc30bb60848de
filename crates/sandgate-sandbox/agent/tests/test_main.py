"""Start-up (main.py, bootstrap.py): the ready frame, the two ways in (the archive as a file, the
bootstrap with the archive on its command line), and what the bootstrap keeps alive."""

from agent_harness import AgentProcess, packed_archive


def test_ready_frame(agent, kernel):
    ready = agent.ready
    assert ready["protocol"] == 2
    assert ready["pid"] == agent.proc.pid
    assert ready["kernel_pid"] != agent.proc.pid, "cells run in a process of their own"
    assert isinstance(ready["python"], str) and ready["python"].startswith("3.")
    # Ready comes before the shell is built, so the frame can only say whether IPython is on the
    # path; whether cells really run in it shows in a cell.
    result, _ = agent.run("'get_ipython' in dir()")
    assert result["result"]["text/plain"] == str(kernel[0].startswith("ipython")), result


def test_restart_when_started_with_dash_c(kernel, tmp_path, workdir):
    home = tmp_path / "home"
    home.mkdir()
    agent = AgentProcess(kernel[1], home, kernel[2], workdir, via_c=True)
    try:
        agent.run("lost = 1")
        assert agent.ok("restart", timeout=60)[1]["restarted"] is True
        result, _ = agent.run("'lost' in globals()")
        assert result["result"]["text/plain"] == "False"
    finally:
        agent.close()


def anonymous_kib(pid):
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Anonymous:"):
                return int(line.split()[1])
    raise AssertionError(f"no Anonymous line for pid {pid}")


def test_the_bootstrap_keeps_no_parse_tree_alive(kernel, tmp_path, workdir):
    # Running one big source as the `-c` program would keep its parse tree for the process's whole
    # life; imported from the archive, each module's tree goes as soon as it is compiled. The
    # bootstrap must keep nothing of its own either (the decoded archive, a tree): through it, the
    # kernel (which inherits the archive's descriptor) holds no more anonymous memory than one
    # started from the archive file, and the agent no more than its command line costs (CPython
    # keeps ~20 bytes per character of it). Same interpreter, same agent, measured side by side.
    sizes = {}
    for via_c in (False, True):
        home = tmp_path / f"home-{via_c}"
        home.mkdir()
        agent = AgentProcess(kernel[1], home, kernel[2], workdir, via_c=via_c)
        try:
            # The kernel's numbers only settle once the data stack's background import is done:
            # importing what it preloads waits for that.
            preloaded = agent.ready["preloaded"]
            agent.run(f"for name in {preloaded!r}: __import__(name)")
            result, _ = agent.run("import sys; sys.argv")
            if via_c:
                assert result["result"]["text/plain"] == "['-c', 'kernel']", result
            agent.ok("ping")
            sizes[via_c] = {
                "agent": anonymous_kib(agent.ready["pid"]),
                "kernel": anonymous_kib(agent.ready["kernel_pid"]),
            }
        finally:
            agent.close()
    file, bootstrap = sizes[False], sizes[True]
    argument_kib = len(packed_archive()) * 24 // 1024
    # Give or take 2 MiB: what the data stack's threads and arenas hold varies that much from one
    # run to the next; a parse tree of the package would be twice that.
    assert bootstrap["kernel"] < file["kernel"] + 2048, (
        f"a kernel started through bootstrap.py should hold no more anonymous memory than one "
        f"started from the archive file (KiB: {sizes})"
    )
    assert bootstrap["agent"] < file["agent"] + argument_kib + 1024, (
        f"an agent started through bootstrap.py should hold no more anonymous memory than one "
        f"started from the archive file, but for its {argument_kib} KiB command line (KiB: {sizes})"
    )
