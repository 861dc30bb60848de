"""The agent's constants: protocol version, limits, paths, and what the environment overrides
(read once, at import: a sandbox's environment never changes)."""

import os
import re

PROTOCOL_VERSION = 2

HOME = os.path.realpath(os.environ.get("SANDGATE_AGENT_HOME") or "/home/user")

# The sandbox user: cells and commands run as this uid/gid (when the agent runs as root).
USER_UID = 1000
USER_GID = 1000

# Defaults for arguments the gateway normally always sends.
DEFAULT_OUTPUT_LIMIT = 1 << 20
# Room kept beyond a call's output limit for the truncation marker and JSON framing.
MARKER_SLACK = 4096
# Decoded image bytes one cell may send (PNG charts); more are dropped and the cell is truncated.
DISPLAY_LIMIT = 32 << 20
# File data travels in chunks of at most this many raw bytes (PROTOCOL.md, read_file).
CHUNK_SIZE = 256 * 1024
# A frame longer than this is refused instead of buffered: one huge line must not exhaust memory.
# It is far above the largest legitimate frame (a write chunk of 256 KiB is ~350 KB of base64, a
# cell's source is rarely more than a few MB).
MAX_FRAME_BYTES = 64 << 20
# Chunks of a write_file wait in a bounded queue so a slow disk pushes back on the gateway instead of
# the agent buffering an entire upload in memory.
WRITE_QUEUE_CHUNKS = 32
# An upload whose next chunk does not arrive within this time is abandoned (temp file removed).
WRITE_IDLE_TIMEOUT_S = 300.0
# After a command's main process has exited we still collect what is already in its pipes, but do
# not wait longer than this for EOF (a process that escaped the group may hold the pipe open).
COMMAND_DRAIN_S = 0.2
# How long a sweep keeps killing leftover processes (a fork loop races it) before giving up.
SWEEP_S = 2.0
# Most background jobs running at once.
MAX_JOBS = 8
# Where a background job's output goes (created by the job itself, as the sandbox user).
JOBS_DIR = "/tmp/sandgate-jobs"
# How long, after the kernel exited, the agent waits to have read every frame it wrote.
READ_AFTER_EXIT_S = 2.0
# How long a fresh kernel may take to say ready (it preloads the data stack first).
KERNEL_READY_S = 120.0

# The kernel's end of its pipes to the agent, named in its environment: "<input fd>,<output fd>".
ENV_KERNEL_FDS = "SANDGATE_KERNEL_FDS"
# The descriptor of the agent's archive that the kernel inherits (bootstrap.py imports from it).
ENV_ARCHIVE_FD = "SANDGATE_AGENT_ARCHIVE_FD"

# What the model is told when the sandbox's process limit stops the agent from starting something.
AT_PROCESS_LIMIT = (
    "the sandbox is at its process limit (too many processes or threads, e.g. a fork bomb); end "
    "what holds them (kill_job for a background job) and retry"
)

# The package index relay (PROTOCOL.md, "index_serve"; packages.py): where it listens (loopback
# inside the container; the image's pip.conf names this port).
INDEX_PORT = int(os.environ.get("SANDGATE_AGENT_INDEX_PORT") or 3141)
# Where pip installs packages for the sandbox user (`pip install --user`, set in pip.conf).
PACKAGES_BASE = os.environ.get("SANDGATE_AGENT_PACKAGES") or "/opt/packages"
# The longest path the relay forwards; project names and wheel file names are far shorter.
INDEX_MAX_PATH = 1024
# How long a pip request waits for the gateway's next frame before it gets 504.
INDEX_FRAME_TIMEOUT_S = 120.0
# Requests relayed at once (pip makes a handful); beyond, pip is answered 503 at once.
INDEX_MAX_PENDING = 16
# Notes the relay keeps for the pip wrapper (what the gateway refused and why).
INDEX_MAX_NOTES = 50
# How long a pip request waits for the gateway to open the relay after the agent asked for it
# (an `index_wanted` event on a running call); the gateway opens it in milliseconds.
INDEX_WANTED_WAIT_S = 10.0
# What pip hears when no call holds the relay open (a background job, or a gateway without it).
INDEX_NOT_SERVING = (
    "package installs work only inside a call (run_terminal_command, execute_code, "
    "install_packages), not in background jobs"
)
INDEX_PATH = re.compile(r"^/(simple/(?:[A-Za-z0-9._-]+/)?|files/[0-9a-f]{64}/[A-Za-z0-9._+!-]+)$")

# Egress (PROTOCOL.md, "egress_serve"; egress.py): the HTTP proxy on loopback inside the container
# that HTTPS_PROXY names once the gateway turned egress on (`egress_env`).
EGRESS_PORT = int(os.environ.get("SANDGATE_AGENT_EGRESS_PORT") or 3128)
# Where the agent keeps the egress CA bundle it writes for user processes (tmpfs).
EGRESS_STATE_DIR = os.environ.get("SANDGATE_AGENT_EGRESS_DIR") or "/tmp/.sandgate-egress"
# The system's CA bundle, the first that exists (Debian's ca-certificates first).
SYSTEM_CA_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt")
# At most this many egress CAs are kept in the bundle (one per gateway process that served it).
EGRESS_MAX_CAS = 8
# The longest request head the proxy reads (a CONNECT line and a few headers).
EGRESS_MAX_HEAD = 16 * 1024
# Bytes read from a client at a time (one egress_data event each).
EGRESS_CHUNK = 64 * 1024
# Connections relayed at once; beyond, a CONNECT is answered 503 at once.
EGRESS_MAX_CONNECTIONS = 32
# Data events of one connection the gateway has not yet acknowledged (written on to the server)
# when its serve call asked for acknowledgements: the client's socket is read only below it, so a
# server that stops reading stalls its own connection, never the agent's output to the gateway.
EGRESS_WINDOW_EVENTS = 16
# How long a CONNECT waits for the gateway's decision (it resolves and dials first).
EGRESS_OPEN_TIMEOUT_S = 60.0
# A tunnel whose gateway side sends nothing for this long ends (as does a client reading nothing).
EGRESS_IDLE_TIMEOUT_S = 300.0
# How long the agent's reader waits to queue a gateway chunk for a client that is not reading
# before that connection is given up (the reader serves every other frame too).
EGRESS_ROUTE_WAIT_S = 5.0
# How long a CONNECT waits for the gateway to open the relay after the agent asked for it.
EGRESS_WANTED_WAIT_S = 10.0
# What a client hears when the sandbox's tenant has no egress policy.
EGRESS_OFF = (
    "this sandbox has no route out: its tenant has no egress policy (an operator allows hosts "
    "with `sandgate admin tenant egress <tenant> --allow host:port`)"
)
# What a client hears when no call holds the relay open (a background job between calls).
EGRESS_NOT_SERVING = (
    "egress works only inside a call (execute_code, run_terminal_command), not in background "
    "jobs between calls"
)
# What a plain http:// request through the proxy hears.
EGRESS_PLAIN_HTTP = (
    "sandgate's egress proxy relays HTTPS only (CONNECT host:port): plain http:// requests are "
    "not relayed; use https://"
)
