# The sandbox container's command: `python3 -u -c <this file> <agent.py's source>`.
#
# Why not `python3 -u -c <agent.py's source>`: CPython frees the parse tree of a `-c` program only
# when the program returns, and the agent never does. For agent.py that tree is ~2.5 MB, kept for
# the sandbox's whole life in the agent and again in its kernel (started the same way), and the
# parser's scratch memory another ~2 MB each. Compiled here instead, the tree is freed at once, and
# malloc_trim hands the freed pages back (glibc; anywhere else this step does nothing).
import sys

_agent_code = compile(sys.argv.pop(1), "<string>", "exec")
try:
    import ctypes

    ctypes.CDLL(None).malloc_trim(0)
except (OSError, AttributeError):
    pass
exec(_agent_code)
