"""Re-seeding after a restore from a memory snapshot (PROTOCOL.md, `restored`).

A sandbox restored from a checkpoint resumes with the memory of the sandbox that was checkpointed,
generators included: every clone of one template would draw the same "random" numbers, temporary
file names, multiprocessing authkeys and OpenSSL randoms (a restore keeps pids, so OpenSSL's fork
detection never fires). `reseed` gives each generator a process holds fresh state; the agent runs
it in its own process and has the kernel run it in its. What cannot be re-seeded (the string hash
seed, the address-space layout, stack canaries) is in docs/snapshots.md."""

import hashlib
import os
import sys


def fresh_seed(given):
    """64 bytes from the gateway's seed and this machine's entropy: a clone is re-seeded right even
    should one of the two sources repeat itself across restores."""
    return hashlib.sha512(bytes(given) + os.urandom(64)).digest()


def _derived(seed, label):
    return hashlib.sha512(seed + b"\0" + label).digest()


def reseed(seed):
    """Re-seeds, from the 64-byte `seed`, every generator of this process that a clone must not
    share; returns their names. numpy's, tempfile's and multiprocessing's only where the module is
    loaded (one loaded later starts from fresh entropy anyway)."""
    import random
    import ssl

    done = []
    random.seed(_derived(seed, b"random"))
    done.append("random")
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        words = _derived(seed, b"numpy")
        try:
            numpy.random.seed([int.from_bytes(words[i : i + 4], "little") for i in range(0, 64, 4)])
            done.append("numpy")
        except Exception:  # a broken numpy must not fail the restore
            pass
    tempfile = sys.modules.get("tempfile")
    if tempfile is not None:
        # Its name generator re-seeds itself only when the pid changes; dropping it makes the next
        # name come from a new one (seeded from os.urandom).
        tempfile._name_sequence = None
        done.append("tempfile")
    process = sys.modules.get("multiprocessing.process")
    if process is not None:
        process.current_process().authkey = _derived(seed, b"multiprocessing")[:32]
        done.append("multiprocessing")
    # Mixed into OpenSSL's primary generator: its children (the public and private generators of
    # every thread) reseed from it before their next output.
    ssl.RAND_add(_derived(seed, b"openssl"), 64.0)
    done.append("openssl")
    return done
