"""The start of both roles: `python3 -u -c <bootstrap.py> <archive> [kernel]` (the container),
or `python3 -u <the archive or the agent directory> [kernel]` (tests), ends up here."""

import os
import sys
import traceback


def release_freed_memory():
    """Hands the pages freed since start-up (the parse trees and scratch memory of compiling the
    package's modules) back to the system: glibc keeps them otherwise. Elsewhere this does
    nothing."""
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def main(archive_fd=None):
    """Runs the role the command line names (`kernel`, or the agent) until the process ends.
    `archive_fd`: the descriptor of the archive the package runs from, when bootstrap.py made it
    (the kernel inherits it)."""
    started = []  # the role's Runtime, once it exists
    try:
        if sys.argv[1:] == ["kernel"]:
            from . import cells as role
        elif sys.argv[1:] == ["zygote"]:
            from . import zygote as role
        else:
            from . import supervisor as role
        release_freed_memory()
        role.main(started.append, archive_fd)
    except BaseException:
        # Make a start-up failure visible in the container log.
        message = f"fatal: {traceback.format_exc()}"
        if started:
            started[0].log(message)
            started[0].shutdown(1)
        try:
            os.write(2, f"sandgate-agent: {message}\n".encode("utf-8", "replace"))
        finally:
            os._exit(1)
