"""What a 3FS node keeps beside its segments: pointer records (``index/``), its node file and
lock (``nodes/``). Small POSIX I/O; format in ``hf3fs_format.py``, slots in ``hf3fs_space.py``."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
import uuid

from hicached.backends.hf3fs_format import Pointer
from hicached.errors import ConfigError

# ---------------------------------------------------------------- pointer records (small POSIX I/O)


def read_pointer(path: str) -> Pointer | None:
    """The pointer record at ``path``; None if there is none (or it is not a valid record)."""
    try:
        with open(path, "rb") as f:
            return Pointer.unpack(f.read(4096))
    except FileNotFoundError:
        return None


def publish_pointer(path: str, ptr: Pointer, mode: int) -> None:
    """Write ``ptr`` to a temp file and rename it over ``path``: readers see the old record,
    the new one, or none, never a partial one (rename atomicity). Raises OSError."""
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.write(fd, ptr.pack())
    finally:
        os.close(fd)
    try:
        os.rename(tmp, path)
    except OSError:
        os.unlink(tmp)
        raise


def remove_pointer_if(path: str, want: Pointer) -> bool:
    """Unlink ``path`` if it still names ``want``'s slot and generation (another node may have
    republished the key meanwhile; its pointer stays). True if removed, False if it names
    another slot or is gone; OSError when that cannot be told (the pointer may remain)."""
    try:
        if read_pointer(path) != want:
            return False
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


# ---------------------------------------------------------------- node identity


def lock_node(root: str, node: str, mode: int, wait_s: float = 5.0) -> int:
    """flock ``nodes/<node>.lock``: two daemons of one host never share a node (3FS's FUSE
    client keeps flocks local to the host; across hosts the host check of ``bump_epoch``
    catches a name given twice). Waits up to ``wait_s`` for a holder that is closing (a
    detached backend of this daemon, closed once its last job is collected). Returns the fd."""
    nodes = os.path.join(root, "nodes")
    os.makedirs(nodes, exist_ok=True)
    lock_fd = os.open(os.path.join(nodes, f"{node}.lock"), os.O_RDWR | os.O_CREAT, mode)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return lock_fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(lock_fd)
                raise ConfigError(
                    f"hf3fs: node {node!r} under {root} is in use by another daemon on this "
                    f"host; give each daemon its own l3_options 'node'") from None
            time.sleep(0.05)


def bump_epoch(root: str, node: str) -> tuple[bytes, int]:
    """(uuid, epoch) of ``node``: the uuid survives restarts in ``nodes/<node>.json``; the
    epoch grows by one per call (it prefixes generations, so a restarted node never reuses
    one). The file is replaced by rename, so a crash leaves the old or the new one."""
    os.makedirs(os.path.join(root, "nodes"), exist_ok=True)  # (gone after a wipe of the root)
    path = os.path.join(root, "nodes", f"{node}.json")
    host = socket.gethostname()
    try:
        with open(path) as f:
            info = json.load(f)
        node_uuid = bytes.fromhex(info["uuid"])
        epoch = int(info["epoch"]) + 1
    except FileNotFoundError:
        node_uuid, epoch = uuid.uuid4().bytes, 1
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"hf3fs: cannot read node file {path}: {e}") from None
    else:
        if info.get("host") != host:
            raise ConfigError(
                f"hf3fs: node {node!r} under {root} belongs to host {info.get('host')!r} "
                f"({path}), this is {host!r}; set l3_options 'node' to a name of its own")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"node": node, "uuid": node_uuid.hex(), "host": host, "epoch": epoch}, f)
    os.rename(tmp, path)
    return node_uuid, epoch
