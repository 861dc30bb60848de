"""Re-seeding after a restore (reseed.py, and the supervisor's `restored` op): two clones of one
process state draw different numbers after it, and so does the kernel of a running agent."""

import multiprocessing
import os
import random
import subprocess
import sys
import tempfile

from agent_harness import AGENT_DIR

SEED = "ab" * 32


def _draws():
    """What a clone would give away: its generators' next outputs."""
    import numpy

    return (
        random.random(),
        float(numpy.random.rand()),
        next(tempfile._get_candidate_names()),
        bytes(multiprocessing.current_process().authkey),
    )


def test_reseed_makes_clones_of_one_state_draw_differently():
    """Clones of one memory image (here: one process state put back) share every generator until
    each is re-seeded; after it, no two draw the same, nor the same as the original."""
    sys.path.insert(0, str(AGENT_DIR))
    try:
        from sandgate_agent.reseed import fresh_seed, reseed
    finally:
        sys.path.remove(str(AGENT_DIR))
    import numpy

    random.seed(7)
    numpy.random.seed(7)
    state = (random.getstate(), numpy.random.get_state())
    original = _draws()
    clones = []
    for _ in range(2):
        random.setstate(state[0])
        numpy.random.set_state(state[1])
        assert _draws()[:2] == original[:2], "put back, the state repeats itself"
        random.setstate(state[0])
        numpy.random.set_state(state[1])
        done = reseed(fresh_seed(bytes.fromhex(SEED)))
        assert {"random", "numpy", "tempfile", "multiprocessing", "openssl"} <= set(done), done
        clones.append(_draws())
    for i in range(4):
        assert len({original[i], clones[0][i], clones[1][i]}) == 3, (i, original, clones)


def test_reseed_changes_openssl_output_of_a_forked_clone():
    """A fork without exec shares OpenSSL's state with its parent; after `reseed` the child's
    RAND_bytes differ from the parent's next ones (the same holds for restored clones)."""
    code = f"""
import os, ssl, sys
sys.path.insert(0, {str(AGENT_DIR)!r})
from sandgate_agent.reseed import fresh_seed, reseed
ssl.RAND_bytes(16)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    reseed(fresh_seed(b"x" * 32))
    os.write(w, ssl.RAND_bytes(16))
    os._exit(0)
os.waitpid(pid, 0)
child = os.read(r, 16)
print(child != ssl.RAND_bytes(16))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "True", out


def test_restored_reseeds_the_kernel_and_takes_the_identity(agent):
    agent.run("import random, tempfile\nrandom.seed(3)\nexpected = random.random()\nrandom.seed(3)")
    _, answer = agent.ok("restored", sandbox_id="sbx_clone", seed=SEED, timeout=60)
    assert answer["sandbox_id"] == "sbx_clone" and answer["pid"] == agent.proc.pid, answer
    assert {"random", "openssl"} <= set(answer["reseeded"]), answer
    assert answer["kernel_pid"] == agent.ready["kernel_pid"], answer
    assert {"random", "tempfile", "openssl"} <= set(answer["kernel_reseeded"]), answer
    result, _ = agent.run("random.random() != expected")
    assert result["result"]["text/plain"] == "True"


def test_restored_is_answered_while_a_cell_runs(agent):
    running = agent.start("exec", code="import time\ntime.sleep(2)")
    agent.wait_busy()
    _, answer = agent.ok("restored", sandbox_id="sbx_busy", seed=SEED, timeout=60)
    assert answer["kernel_reseeded"], answer
    assert agent.poll_final(running) is None, "the cell still runs"
    _, done = agent.wait(running)
    assert done["ok"], done


def test_restored_refuses_a_bad_request(agent):
    for args in (
        {"seed": SEED},
        {"sandbox_id": "sbx_x", "seed": "zz"},
        {"sandbox_id": "sbx_x", "seed": "ab" * 8},
        {"sandbox_id": 5, "seed": SEED},
    ):
        _, final = agent.call("restored", **args)
        assert not final["ok"] and final["error"]["kind"] == "bad_request", (args, final)
    assert agent.ok("ping")[1]["pong"] is True
