"""Who a 3FS node is: its lock, its node file, and what it does when it lost the node file.

    nodes/<node>.lock            flock held while a daemon runs the node (one per host)
    nodes/<node>.json            {"node", "uuid", "host", "epoch"}: the uuid names the node's
                                 segment directory and survives restarts; the epoch grows by one
                                 at every start (it prefixes generations: never one reused)
    segments/<uuid>/owner.json   {"node", "host"}: lets a node that lost its node file find
                                 (and delete) the segments of its former identity

Both JSON files are replaced whole (``write_file_atomic``: temp file, fsync, rename). A node
file found empty, cut short or unreadable anyway (a crash of an older version, a damaged disk)
is not an error: the node starts afresh under a new uuid, and the segment directories whose
owner file names this node and host are its former self's, deleted with their pointers
(``remove_lost_segments``): nothing else writes them, and a slot is never reused under a
pointer, so readers get the old pages or misses. A directory of an older version has no owner
file and stays (wasted space, logged).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
import uuid
from typing import NamedTuple

from hicached.backends.hf3fs.format import (
    BLOCK,
    DIR_ENTRY_BYTES,
    DirEntry,
    Pointer,
    SegmentHeader,
    pointer_relpath,
)
from hicached.backends.hf3fs.records import remove_pointer_if, write_file_atomic
from hicached.errors import ConfigError

log = logging.getLogger(__name__)

OWNER = "owner.json"


class NodeId(NamedTuple):
    """A node's identity for this run; ``lost``: the node file was damaged, this is a new
    uuid (the caller removes the former identity's segments)."""

    uuid: bytes
    epoch: int
    lost: bool = False


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


def _read_node_file(path: str) -> dict | None:
    """The node file's fields; None when there is none; ValueError when it is damaged."""
    try:
        with open(path, "rb") as f:
            info = json.loads(f.read(65536))
    except FileNotFoundError:
        return None
    except UnicodeDecodeError as e:
        raise ValueError(str(e)) from None
    try:  # (TypeError too for JSON that is not an object)
        info["uuid"] = bytes.fromhex(info["uuid"])
        info["epoch"] = int(info["epoch"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"no valid uuid and epoch ({e})") from None
    if len(info["uuid"]) != 16 or info["epoch"] < 0:
        raise ValueError(f"uuid {info['uuid'].hex()!r} / epoch {info['epoch']} out of range")
    return info


def bump_epoch(root: str, node: str, current: NodeId | None = None, mode: int = 0o644
               ) -> NodeId:
    """``node``'s identity with the next epoch, written back to ``nodes/<node>.json``.

    At start (``current`` None) the file says who the node is; none: a new node; damaged: a
    new uuid with ``lost`` set (logged). A running node passes its ``current`` identity, which
    wins over the file (the epoch still passes the file's, if that is the same node's).
    ``ConfigError`` when the file names another host (a node name given twice)."""
    nodes = os.path.join(root, "nodes")
    os.makedirs(nodes, exist_ok=True)  # (gone after a wipe of the root)
    path = os.path.join(nodes, f"{node}.json")
    host = socket.gethostname()
    lost = False
    try:
        info = _read_node_file(path)
    except ValueError as e:
        info = None
        if current is None:
            lost = True
            log.warning("hf3fs: node file %s is damaged (%s; a crash while writing it?): node "
                        "%s starts afresh under a new uuid", path, e, node)
    if info is not None and info.get("host") != host:
        raise ConfigError(
            f"hf3fs: node {node!r} under {root} belongs to host {info.get('host')!r} "
            f"({path}), this is {host!r}; set l3_options 'node' to a name of its own")
    if current is not None:
        file_epoch = info["epoch"] if info is not None and info["uuid"] == current.uuid else 0
        new = NodeId(current.uuid, max(file_epoch, current.epoch) + 1)
    elif info is not None:
        new = NodeId(info["uuid"], info["epoch"] + 1)
    else:
        new = NodeId(uuid.uuid4().bytes, 1, lost)
    body = {"node": node, "uuid": new.uuid.hex(), "host": host, "epoch": new.epoch}
    write_file_atomic(path, json.dumps(body).encode(), mode)
    return new


def write_owner(seg_dir: str, node: str, mode: int) -> None:
    """Name ``node`` on this host as the owner of ``seg_dir`` (once; raises OSError)."""
    path = os.path.join(seg_dir, OWNER)
    if not os.path.exists(path):
        body = {"node": node, "host": socket.gethostname()}
        write_file_atomic(path, json.dumps(body).encode(), mode)


def remove_lost_segments(root: str, node: str, keep: bytes) -> int:
    """Delete the segment directories (but ``keep``'s) whose owner file names ``node`` on this
    host, after removing every pointer their directories name; returns how many segments.
    Best effort: an error is logged and leaves that much behind (wasted space only)."""
    top, host, removed = os.path.join(root, "segments"), socket.gethostname(), 0
    try:
        names = os.listdir(top)
    except FileNotFoundError:
        return 0
    for name in names:
        seg_dir = os.path.join(top, name)
        if name == keep.hex():
            continue
        try:
            with open(os.path.join(seg_dir, OWNER), "rb") as f:
                owner = json.loads(f.read(65536))
            old = bytes.fromhex(name)
        except (OSError, ValueError):
            continue  # another node's, or an older version's (no owner file)
        if not isinstance(owner, dict) or (owner.get("node"), owner.get("host")) != (node, host):
            continue
        try:
            for f in sorted(os.listdir(seg_dir)):
                if f.endswith(".seg"):
                    _remove_segment(root, os.path.join(seg_dir, f), old, f[:-4])
                    removed += 1
            os.unlink(os.path.join(seg_dir, OWNER))
            os.rmdir(seg_dir)
        except OSError as e:
            log.warning("hf3fs: cannot remove %s, segments of node %s before its node file was "
                        "lost: %s", seg_dir, node, e)
    if removed:
        log.warning("hf3fs: node %s removed %d segments of its lost former identity", node,
                    removed)
    else:
        log.warning("hf3fs: no segments of node %s's lost former identity found (a directory "
                    "written before owner files existed has none and stays under %s)", node, top)
    return removed


def _remove_segment(root: str, path: str, node_uuid: bytes, name: str) -> None:
    """Remove the pointers a segment's directory names (those still naming its slots), then
    the segment. Raises OSError."""
    with open(path, "rb") as f:
        head = SegmentHeader.unpack(f.read(BLOCK))
        raw = os.pread(f.fileno(), head.num_slots * DIR_ENTRY_BYTES, head.dir_off) if head \
            else b""
    for i in range(len(raw) // DIR_ENTRY_BYTES):
        e = DirEntry.unpack(raw[i * DIR_ENTRY_BYTES:(i + 1) * DIR_ENTRY_BYTES])
        if e is not None and e.state == 1:
            ptr = Pointer(node_uuid, name, i, head.slot_off(i), e.gen, e.page_bytes, e.key_hash)
            remove_pointer_if(os.path.join(root, pointer_relpath(e.ns_name, e.pool_name,
                                                                 e.key_hash)), ptr)
    os.unlink(path)
