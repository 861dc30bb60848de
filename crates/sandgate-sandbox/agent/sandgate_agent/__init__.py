"""sandgate sandbox agent: the main process of every sandbox container.

It speaks the newline-delimited JSON protocol described in PROTOCOL.md (next to this package) over
the container's attached stdin/stdout. The same package runs in two roles:

* the **agent** (``supervisor``; started by the gateway as ``python3 -u -c <bootstrap.py>
  <archive>``, the package as a zip archive, base64-encoded: bootstrap.py imports it from there
  with ``zipimport``; as root with only the capabilities SETUID, SETGID and KILL): owns the
  protocol descriptors, answers ``ping``, runs ``command`` (shell commands and background jobs),
  the file operations, ``interrupt`` and ``restart``, supervises the kernel, and ends every process
  a call leaves behind;
* the **kernel** (``kernel``; the same command line plus ``kernel``, started by the agent as uid
  1000 with no capabilities): runs the Python cells (an IPython ``InteractiveShell`` when IPython
  is importable, plain ``exec`` otherwise) and talks to the agent over a private pair of pipes.

User code (cells and commands) runs as uid 1000 and therefore can neither open the agent's
descriptors under /proc, nor signal it, nor write a frame the gateway reads: the agent only relays
kernel frames that belong to the cell the kernel is running. When the kernel dies (a segfault,
``os._exit``, ``kill -9``, the out-of-memory killer) the agent says why, starts a fresh kernel, and
files in the home directory stay.

It is stdlib-only on purpose: the Rust gateway embeds this package, so any image with python3 can
be a sandbox profile. IPython, numpy, pandas and matplotlib are used when present and skipped when
not.

The modules, each owning one thing: ``config`` (constants and the environment), ``runtime`` (the
per-process state: protocol writer, log, credentials), ``protocol`` (frames in and out),
``processes`` (credentials, process trees, sweeps), ``output`` (turning output into events),
``files``, ``commands``, ``jobs``, ``packages`` (the package index relay and the user site),
``kernels`` (the agent's side of the kernel: starting it, relaying its frames), ``supervisor`` (the
agent role), and for the kernel role ``cells``, ``shells`` and ``display``; ``main`` picks the role.

Environment: ``SANDGATE_AGENT_HOME`` overrides the home directory (default ``/home/user``), so the
agent can be tested on a host (then, not being root, it runs the kernel and commands as its own
user, and it ends leftover processes among its own descendants only).
"""

import os

# Where this package's files are (inside the zip archive, or a source tree): every code object of
# the agent has a file name under it, which is how tracebacks shown to the user leave them out.
AGENT_ROOT = os.path.dirname(os.path.abspath(__file__))


def is_agent_file(filename):
    """Whether a code object's file name is one of this package's files."""
    return isinstance(filename, str) and filename.startswith(AGENT_ROOT + os.sep)
