"""The shared presence table with an L3 attached (the embedded default, the file L3): what L2
alone cannot answer goes to the daemon, which asks L3; whole-L2 hits are answered from the table."""

import time

import pytest
import torch
from conftest import wait_until
from pools import pages
from test_table_exists import answered_shared, hexkeys, hybrid_client, queries, with_socket_calls

from hicached import PoolTransfer


def test_with_l3_attached_keys_l2_lacks_are_asked_of_the_daemon(daemon):
    """The embedded default (file L3): what only L3 holds is found by the daemon, whole-L2 hits
    are answered from the table."""
    keys = hexkeys(8, tag=7)
    with hybrid_client(daemon) as c:
        c.batch_set_v2([PoolTransfer("kv", pages(0, 8), keys=keys)])
        assert wait_until(lambda: c.stats()["l3_writes"] == 8)
        assert answered_shared(c, lambda: c.batch_exists(keys)) == 8
        c.flush("l2")
        lookups = []
        real = c._conn.shared.view.lookup
        c._conn.shared.view.lookup = lambda k: lookups.append(1) or real(k)
        assert with_socket_calls(c, lambda: c.batch_exists(keys)) == (8, 1)  # L3 has them
        assert len(lookups) == 1
        # L2 alone could not answer: the next call goes to the daemon without hashing the keys
        c.flush("l2")
        assert with_socket_calls(c, lambda: c.batch_exists(keys)) == (8, 1)
        assert len(lookups) == 1
        del c._conn.shared.view.lookup
        # that exists pulled them into L2 (prefetch): then the table answers again
        assert wait_until(lambda: with_socket_calls(c, lambda: c.batch_exists(keys)) == (8, 0))


def test_with_l3_attached_a_whole_l2_hit_with_mamba_holes_is_answered_from_the_table(daemon):
    """A hybrid model keeps Mamba states at some pages only: with L3 attached, an exists that L2
    alone restores at full length is answered from the table (L3 cannot raise any hit), and
    equals the daemon's answer; one that L2 does not restore fully still asks the daemon."""
    keys = hexkeys(8, tag=8)
    with hybrid_client(daemon) as c, hybrid_client(daemon, shared_exists=False) as sock:
        c.batch_set_v2([PoolTransfer("kv", pages(0, 8), keys=keys),
                        PoolTransfer("indexer", pages(0, 8), keys=keys)])
        c.batch_set_v2([PoolTransfer("mamba", torch.arange(2), keys=[keys[3], keys[7]])])
        assert wait_until(lambda: c.stats()["l3_writes"] == 18)
        sock.ping()
        c.ping()
        mine = answered_shared(c, lambda: c.batch_exists_v2(keys, queries(keys)))
        assert mine == sock.batch_exists_v2(keys, queries(keys))
        assert mine.kv_hit_pages == 8 and mine.restorable_prefix_pages == [4, 8]
        more = [*keys, *hexkeys(2, tag=9)]  # a tail nobody stored: only the daemon knows L3
        assert with_socket_calls(c, lambda: c.batch_exists_v2(more, queries(more)).kv_hit_pages
                                 ) == (8, 1)
        ahead = keys[:6]  # restorable up to 4 only (no state at 6): the daemon asks L3
        assert with_socket_calls(c, lambda: c.batch_exists_v2(ahead, queries(ahead))
                                 .kv_hit_pages) == (4, 1)


def test_l3_flag_follows_the_backend(daemon):
    from hicached.presence import F_L3
    with hybrid_client(daemon) as c:  # the embedded default: file L3 attached
        assert c._conn.shared.view.usable() & F_L3
        c.detach_backend()
        assert wait_until(lambda: not c._conn.shared.view.usable() & F_L3)
        from hicached.errors import ProtocolError
        start = time.monotonic()  # keys of the wrong type: the daemon's typed error, at once
        with pytest.raises(ProtocolError, match="malformed request"):
            c.batch_exists([b"0123456789abcdef"])
        assert time.monotonic() - start < 2.0
