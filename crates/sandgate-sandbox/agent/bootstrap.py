# The sandbox container's command: `python3 -u -c <this file> <agent.py>`, agent.py compressed with
# zlib and then base64-encoded (Linux caps one argument at 128 KiB; compressed, the agent takes about
# a third of that, and an argument cannot hold the NUL bytes of raw zlib data).
#
# Why not `python3 -u -c <agent.py's source>`: CPython frees the parse tree of a `-c` program only
# when the program returns, and the agent never does. For agent.py that tree is ~2.5 MB, kept for
# the sandbox's whole life in the agent and again in its kernel (started the same way), and the
# parser's scratch memory another ~2 MB each. Compiled here instead, the tree is freed at once, and
# malloc_trim hands the freed pages back (glibc; anywhere else this step does nothing).
import binascii
import sys
import zlib

_agent_code = compile(zlib.decompress(binascii.a2b_base64(sys.argv.pop(1))), "<string>", "exec")
try:
    import ctypes

    ctypes.CDLL(None).malloc_trim(0)
except (OSError, AttributeError):
    pass
exec(_agent_code)
