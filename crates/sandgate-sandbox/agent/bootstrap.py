# The sandbox container's command: `python3 -u -c <this file> <archive>`, the agent package
# (sandgate_agent/, with __main__.py) as a zip archive of stored (uncompressed) files, compressed
# with zlib as a whole (which packs better than the zip's own compression of each file) and then
# base64-encoded (an argument cannot hold NUL bytes): Linux caps one argument at 128 KiB, and the
# archive takes about a third of that. The image has no copy of the agent: any image with python3
# will do.
#
# The archive goes into an anonymous memory file (memfd; on a file system it would need a place user
# code cannot touch), sealed against writes, and its modules are imported from there with
# zipimport, through the file's /proc/self/fd path; code objects carry file names under that path,
# which is how the agent knows its own frames (sandgate_agent.is_agent_file). Each module is
# compiled as it is imported and its parse tree freed at once. (Running one big source as the `-c`
# program instead would keep its whole parse tree alive in the agent and in its kernel for the
# sandbox's whole life: CPython frees the tree of a `-c` program only when the program returns, and
# the agent never does.) The package's own start (sandgate_agent.main) then hands the freed pages
# back with malloc_trim.
#
# The kernel is started with this file too, as `python3 -u -c <this file> kernel`, and inherits a
# sealed copy of the memfd that it can read (named by SANDGATE_AGENT_ARCHIVE_FD; kernels.py) instead
# of a second copy of the archive on its command line: each character of an argument costs a
# process ~20 bytes for its whole life (the copies CPython keeps), ~1 MB for this one.
import os
import sys


def _archive_fd():
    inherited = os.environ.pop("SANDGATE_AGENT_ARCHIVE_FD", None)
    if inherited is not None:
        fd = int(inherited)
        os.set_inheritable(fd, False)  # the kernel's children (user code) do not get it
        return fd
    import binascii
    import fcntl
    import zlib

    archive = zlib.decompress(binascii.a2b_base64(sys.argv.pop(1)))
    fd = os.memfd_create("sandgate-agent", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    view = memoryview(archive)
    while view:
        view = view[os.write(fd, view) :]
    # Nobody can change the agent's code now, and no other uid can open it (gVisor lets any uid
    # re-open another process's descriptors that the file's mode allows).
    os.fchmod(fd, 0o400)
    seals = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


_fd = _archive_fd()
_path = f"/proc/self/fd/{_fd}"
# On sys.path just long enough to import the package: its modules are then found through the
# package's own __path__, and the user's sys.path in the kernel stays as Python made it.
sys.path.insert(0, _path)
import sandgate_agent.main  # noqa: E402

sys.path.remove(_path)
sandgate_agent.main.main(archive_fd=_fd)
