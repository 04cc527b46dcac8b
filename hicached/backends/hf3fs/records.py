"""Small files of a 3FS root: pointer records (``index/``), the format marker, and how a small
file is replaced so that a crash leaves the old or the new one whole (``write_file_atomic``).
Small POSIX I/O; format in ``format.py``, node files in ``node.py``, slots in
``space.py``."""

from __future__ import annotations

import errno
import json
import logging
import os
import uuid

from hicached.backends.hf3fs.format import FORMAT, MARKER, Pointer
from hicached.errors import ConfigError

log = logging.getLogger(__name__)

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


# ---------------------------------------------------------------- small files, replaced whole


def fsync_dir(path: str) -> None:
    """fsync directory ``path`` (a rename or link in it survives a crash); best effort: some
    filesystems (FUSE ones among them) refuse to fsync a directory."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


_NO_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK)


def write_file_atomic(path: str, data: bytes, mode: int, replace: bool = True) -> bool:
    """Write ``data`` to ``path`` so that nobody, not even after a crash, finds it empty or
    partial: a temp file in the same directory, written and fsynced, then renamed over
    ``path`` (``replace``) or hard-linked to it only if there is none (``replace=False``:
    False when there was one, which stays), then the directory fsynced. Raises OSError."""
    tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.rename(tmp, path)
        else:
            try:
                os.link(tmp, path)  # atomic "create if absent", with the content in place
            except FileExistsError:
                return False
            except OSError as e:  # no hard links here: rename, if there still is none
                if e.errno not in _NO_LINKS or os.path.lexists(path):
                    raise
                os.rename(tmp, path)
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass  # (renamed)
    fsync_dir(os.path.dirname(path))
    return True


# ---------------------------------------------------------------- the root's format marker


def marker_format(raw: bytes) -> int | None:
    """The format a marker file's bytes name, or None when they name none."""
    try:
        info = json.loads(raw)
    except ValueError:
        return None
    fmt = info.get("format") if isinstance(info, dict) else None
    return fmt if isinstance(fmt, int) and not isinstance(fmt, bool) else None


def ensure_marker(root: str, fmt: int = FORMAT) -> None:
    """Make ``<root>/hicached-hf3fs.json`` say ``{"format": fmt}``: written (whole, see
    ``write_file_atomic``) when missing or empty (a crash of an older version that wrote it in
    place), accepted when it names ``fmt``. Anything else raises ``ConfigError``: the root may
    hold another format's data, so it is never overwritten. Raises OSError on I/O errors."""
    path = os.path.join(root, MARKER)
    want = b'{"format": %d}\n' % fmt
    for _ in range(3):
        try:
            with open(path, "rb") as f:
                raw = f.read(4096)
        except FileNotFoundError:
            if write_file_atomic(path, want, 0o644, replace=False):
                return
            continue  # another node wrote it meanwhile: read theirs
        if marker_format(raw) == fmt:
            return
        if raw.strip():
            raise ConfigError(
                f"hf3fs: {path} does not mark format {fmt} ({raw[:200]!r}): the root holds "
                f"another format's data, or the marker is damaged (then remove it)")
        log.warning("hf3fs: format marker %s is empty (a crash while writing it?); writing it",
                    path)
        write_file_atomic(path, want, 0o644)
        return
    raise ConfigError(f"hf3fs: {path} keeps changing under this daemon")


def prepare_root(root: str) -> None:
    """Create ``root`` when missing and check it is a writable directory with our marker
    (``ensure_marker``); any failure is a ``ConfigError``."""
    try:
        os.makedirs(root, exist_ok=True)
        if not os.access(root, os.W_OK | os.X_OK):
            raise PermissionError(f"no write permission on {root}")
        ensure_marker(root)
    except OSError as e:
        raise ConfigError(f"hf3fs: root {root} is not a writable directory: {e}") from e


def clear_root(root: str) -> int:
    """Delete every pointer record and segment file under ``root`` (all nodes'); returns how
    many pointer records were removed. What cannot be deleted stays (counted as not removed)."""
    n = 0
    for top in ("index", "segments"):
        for dirpath, _, files in os.walk(os.path.join(root, top), topdown=False):
            for f in files:
                try:
                    os.unlink(os.path.join(dirpath, f))
                except OSError:
                    continue
                if top == "index" and ".tmp-" not in f:
                    n += 1
            try:
                os.rmdir(dirpath)
            except OSError:
                pass
    return n
