"""The arena: created pre-sized with its mode, shared between mappings, unlinked by its owner."""

import os
import stat

import pytest

from hicached.arena import Arena
from hicached.errors import ArenaError


def test_create_attach_share_bytes(shm_path):
    a = Arena.create(shm_path, 1 << 16, mode=0o600)
    assert stat.S_IMODE(os.stat(shm_path).st_mode) == 0o600
    b = Arena.attach(shm_path, 1 << 16)
    a.tensor[100:104] = 7
    assert b.tensor[100:104].tolist() == [7, 7, 7, 7]
    b.view(200, 3)[:] = b"abc"
    assert bytes(a.view(200, 3)) == b"abc"
    b.close()
    a.close()
    assert not os.path.exists(shm_path)


def test_create_replaces_stale_file(shm_path):
    with open(shm_path, "wb") as f:
        f.write(b"stale")
    a = Arena.create(shm_path, 4096)
    assert os.path.getsize(shm_path) == 4096
    a.close()


def test_attach_size_mismatch_and_missing(shm_path):
    a = Arena.create(shm_path, 4096)
    with pytest.raises(ArenaError, match="4096 bytes"):
        Arena.attach(shm_path, 8192)
    a.close()
    with pytest.raises(ArenaError, match="cannot open"):
        Arena.attach(shm_path, 4096)


def test_view_bounds(arena):
    with pytest.raises(ArenaError, match="outside arena"):
        arena.view(arena.size_bytes - 10, 11)


def test_daemon_side_maps_without_torch(shm_path):
    """The daemon's modules and an arena's creation do not import torch (most of a daemon's
    start when they did), nor aiohttp without an admin port; the tensor view imports torch on
    first use."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "import hicached.ops.cli, hicached.ops.serve\n"
        "from hicached.arena import Arena\n"
        f"a = Arena.create({shm_path!r}, 1 << 16)\n"
        "a.view(0, 2)[:] = b'ok'\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "assert 'aiohttp' not in sys.modules, 'aiohttp imported'\n"
        "assert bytes(a.tensor[:2].tolist()) == b'ok'\n"
        "assert 'torch' in sys.modules\n"
        "a.close()\n"
        "assert a.tensor is None\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert not os.path.exists(shm_path)
