"""Files (PROTOCOL.md, "write_file", "read_file", "list_dir" and "Paths"): uploads in chunks,
downloads in chunks, directory listings, each acting as the sandbox user, confined to the home.

Confinement is checked on the resolved path. File operations run acting as the sandbox user (see
processes.Credentials), so this is a guard against gateway/model mistakes, not a security boundary
against code in the sandbox: a cell racing a symlink swap against a file op only reaches what it
could reach anyway.
"""

import base64
import binascii
import errno
import hashlib
import os
import queue
import stat
import tempfile

from .config import CHUNK_SIZE, HOME, WRITE_IDLE_TIMEOUT_S, WRITE_QUEUE_CHUNKS
from .protocol import OpError


def resolve_path(path, default="."):
    """The real path of `path` (relative to the home), refused unless it is inside the home."""
    if path is None:
        path = default
    if not isinstance(path, str):
        raise OpError("bad_request", "path must be a string")
    if "\x00" in path:
        raise OpError("bad_request", "path contains a NUL byte")
    if path == "":
        path = "."
    # An absolute path replaces HOME in the join; realpath then resolves "..", and every symlink
    # along the way (a symlinked parent directory included).
    real = os.path.realpath(os.path.join(HOME, path))
    if real != HOME and not real.startswith(HOME + os.sep):
        raise OpError("outside_home", f"path {path!r} is outside {HOME}")
    return real


def io_error(err, path):
    """Maps an OSError to the protocol's error kinds."""
    mapping = {
        errno.ENOENT: "not_found",
        errno.EISDIR: "is_directory",
        errno.ENOTDIR: "not_a_directory",
        errno.EEXIST: "exists",
    }
    kind = mapping.get(err.errno, "io")
    return OpError(kind, f"{path}: {err.strerror or err}")


# --------------------------------------------------------------------------------------------------
# Matplotlib


def checked_cwd(path):
    """`path` resolved, as a directory a command can start in."""
    cwd = resolve_path(path)
    if not os.path.exists(cwd):
        raise OpError("not_found", f"{cwd} does not exist")
    if not os.path.isdir(cwd):
        raise OpError("not_a_directory", f"{cwd} is not a directory")
    return cwd


def current_umask():
    """This process's umask (reading it means setting it; it is set back at once)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def space():
    """Bytes used and left in the home directory's file system (its quota)."""
    try:
        st = os.statvfs(HOME)
    except OSError:
        return None
    return {
        "total": st.f_blocks * st.f_frsize,
        "used": (st.f_blocks - st.f_bfree) * st.f_frsize,
        "free": st.f_bavail * st.f_frsize,
    }


class Files:
    """The file ops. They run acting as the sandbox user: their path checks on the reader thread
    (the supervisor's `USER_OPS`), their work on a thread of its own that switches too."""

    def __init__(self, rt, state_lock, spawn):
        self.rt = rt
        self.writer = rt.writer
        self.state_lock = state_lock
        self.spawn = spawn  # the supervisor's FrameServer.spawn
        self.uploads = {}  # request id -> queue of chunk frames of a running write_file
        self.upload_tmp = {}  # request id -> temporary file of a running write_file

    def ops(self):
        """The ops this part answers, by name."""
        return {
            "write_file": self.op_write_file,
            "read_file": self.op_read_file,
            "list_dir": self.op_list_dir,
        }

    def op_write_file(self, req_id, frame):
        target = resolve_path(frame.get("path"), default=None)
        size = frame.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise OpError("bad_request", "write_file needs a non-negative integer 'size'")
        overwrite = bool(frame.get("overwrite", False))
        if target == HOME or os.path.isdir(target):
            raise OpError("is_directory", f"{target} is a directory")
        if os.path.lexists(target) and not overwrite:
            raise OpError("exists", f"{target} exists")
        chunks = queue.Queue(maxsize=WRITE_QUEUE_CHUNKS)
        with self.state_lock:
            self.uploads[req_id] = chunks
        self.spawn("write_file", self.run_write, req_id, target, size, overwrite, chunks, as_user=True)

    def route_chunk(self, req_id, frame):
        """Hands a chunk frame to the upload it belongs to."""
        with self.state_lock:
            chunks = self.uploads.get(req_id)
        # Chunks of an upload that was refused, has failed or was cut off by a restart are dropped
        # silently: that request already has (or will never get) its one final frame.
        while chunks is not None:
            try:
                chunks.put(frame, timeout=1.0)
                return
            except queue.Full:
                # The writer may have failed meanwhile; then nobody will empty this queue.
                with self.state_lock:
                    if self.uploads.get(req_id) is not chunks:
                        return

    def run_write(self, req_id, target, size, overwrite, chunks):
        tmp_path = None
        try:
            parent = os.path.dirname(target)
            try:
                os.makedirs(parent, exist_ok=True)
            except FileExistsError:
                raise OpError("not_a_directory", f"{parent} exists and is not a directory")
            except OSError as err:
                raise io_error(err, parent)
            # makedirs may have walked through a symlink created meanwhile; check again.
            if resolve_path(parent) != parent:
                raise OpError("outside_home", f"{parent} is outside {HOME}")
            digest = hashlib.sha256()
            written = 0
            try:
                fd, tmp_path = tempfile.mkstemp(
                    dir=parent, prefix=f".{os.path.basename(target)}.", suffix=".sandgate-tmp"
                )
            except OSError as err:
                raise io_error(err, parent)
            with self.state_lock:
                self.upload_tmp[req_id] = tmp_path
            with os.fdopen(fd, "wb") as f:
                last = size == 0  # an empty file needs no chunk; a stray empty one is dropped
                while not last:
                    try:
                        chunk = chunks.get(timeout=WRITE_IDLE_TIMEOUT_S)
                    except queue.Empty:
                        raise OpError(
                            "io", f"upload stalled: no chunk for {WRITE_IDLE_TIMEOUT_S:.0f}s"
                        )
                    data = chunk.get("data", "")
                    try:
                        raw = base64.b64decode(data, validate=True) if data else b""
                    except (binascii.Error, TypeError, ValueError):
                        raise OpError("bad_request", "chunk data is not valid base64")
                    written += len(raw)
                    if written > size:
                        raise OpError("bad_request", f"more data than the announced {size} bytes")
                    digest.update(raw)
                    try:
                        f.write(raw)
                    except OSError as err:
                        raise io_error(err, target)
                    last = bool(chunk.get("last", False))
                if written != size:
                    raise OpError("bad_request", f"got {written} bytes, {size} announced")
                try:
                    f.flush()
                    os.fchmod(f.fileno(), 0o666 & ~current_umask())
                except OSError as err:
                    raise io_error(err, target)
            try:
                if overwrite:
                    os.replace(tmp_path, target)
                else:
                    # link() fails if the target appeared meanwhile: no silent overwrite.
                    os.link(tmp_path, target)
                    os.unlink(tmp_path)
            except IsADirectoryError:
                raise OpError("is_directory", f"{target} is a directory")
            except OSError as err:
                raise io_error(err, target)
            tmp_path = None
            self.writer.ok(req_id, {"path": target, "size": written, "sha256": digest.hexdigest()})
        finally:
            with self.state_lock:
                self.uploads.pop(req_id, None)
                self.upload_tmp.pop(req_id, None)
            # Unblock a reader thread that may be waiting to queue one more chunk.
            while True:
                try:
                    chunks.get_nowait()
                except queue.Empty:
                    break
            if tmp_path is not None:
                try:
                    os.unlink(tmp_path)
                except OSError:
                    pass

    def op_read_file(self, req_id, frame):
        target = resolve_path(frame.get("path"), default=None)
        max_bytes = frame.get("max_bytes")
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 0):
            raise OpError("bad_request", "max_bytes must be a non-negative integer")
        self.spawn("read_file", self.run_read, req_id, target, max_bytes, as_user=True)

    def run_read(self, req_id, target, max_bytes):
        try:
            st = os.stat(target)
        except OSError as err:
            raise io_error(err, target)
        if stat.S_ISDIR(st.st_mode):
            raise OpError("is_directory", f"{target} is a directory")
        if not stat.S_ISREG(st.st_mode):
            # A FIFO or device could block forever or never end.
            raise OpError("io", f"{target} is not a regular file")
        if max_bytes is not None and st.st_size > max_bytes:
            raise OpError(
                "too_large", f"{target} is {st.st_size} bytes, larger than the limit of {max_bytes}"
            )
        digest = hashlib.sha256()
        size = 0
        try:
            with open(target, "rb") as f:
                while True:
                    data = f.read(CHUNK_SIZE)
                    if not data:
                        break
                    size += len(data)
                    if max_bytes is not None and size > max_bytes:
                        # The file grew while being read; what was sent stays short of the limit.
                        raise OpError(
                            "too_large", f"{target} grew beyond the limit of {max_bytes} bytes"
                        )
                    digest.update(data)
                    self.writer.event(req_id, "chunk", data=base64.b64encode(data).decode("ascii"))
        except OSError as err:
            raise io_error(err, target)
        self.writer.ok(
            req_id,
            {"path": target, "size": size, "sha256": digest.hexdigest(), "space": space()},
        )

    def op_list_dir(self, req_id, frame):
        target = resolve_path(frame.get("path"))
        self.spawn("list_dir", self.run_list_dir, req_id, target, as_user=True)

    def run_list_dir(self, req_id, target):
        entries = []
        try:
            with os.scandir(target) as it:
                for entry in it:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue  # vanished meanwhile
                    if stat.S_ISLNK(st.st_mode):
                        kind = "symlink"
                    elif stat.S_ISDIR(st.st_mode):
                        kind = "dir"
                    elif stat.S_ISREG(st.st_mode):
                        kind = "file"
                    else:
                        kind = "other"
                    entries.append(
                        {
                            "name": entry.name,
                            "type": kind,
                            "size": st.st_size,
                            "modified": st.st_mtime,
                        }
                    )
        except OSError as err:
            raise io_error(err, target)
        entries.sort(key=lambda e: e["name"])
        self.writer.ok(req_id, {"path": target, "entries": entries, "space": space()})
