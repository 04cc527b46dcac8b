"""Exists answered from the shared presence table through real daemons (client/table_exists.py)."""

import os
import random
import signal
import threading
import time

import pytest
import torch
from admin_helpers import admin_daemon, sample, scrape
from conftest import RacingWriter, age_heartbeat, wait_until
from pools import indexer_pool, kv_pool, mamba_pool, pages

from hicached import PoolTransfer
from hicached.errors import DaemonUnavailable
from hicached.presence import STALE_S


def hexkeys(n, tag=0, width=64):
    return [f"{tag:08x}{i:0{width - 8}x}" for i in range(n)]


# ---------------------------------------------------------------- through real daemons


def hybrid_client(daemon, namespace="model-a", **kw):
    c = daemon.client(namespace, **kw)
    c.register_mem_host_pool_v2(kv_pool(seed=1), "kv")
    c.register_mem_host_pool_v2(mamba_pool(num_slots=32, seed=2), "mamba")
    c.register_mem_host_pool_v2(indexer_pool(seed=3), "indexer")
    return c


def queries(keys, window=1):
    return [PoolTransfer("mamba", keys=keys[:window], hit_policy="trailing_pages"),
            PoolTransfer("indexer", keys=keys, hit_policy="all_pages")]


def with_socket_calls(c, fn):
    """(``fn()``'s result, how many round trips it made)."""
    calls = []
    real = c._conn.call
    c._conn.call = lambda *a, **k: calls.append(a) or real(*a, **k)
    try:
        return fn(), len(calls)
    finally:
        del c._conn.call


def answered_shared(c, fn):
    """``fn()``'s result, asserting the client answered it from the table (no round trip)."""
    out, calls = with_socket_calls(c, fn)
    assert not calls, "exists went through the socket"
    return out


def test_shared_answers_equal_the_daemons_over_random_holes(make_daemon):
    daemon = make_daemon(extra=["--l3-backend", "none"])
    rng = random.Random(5)
    with hybrid_client(daemon) as c, hybrid_client(daemon, shared_exists=False) as sock:
        assert c._conn.shared is not None and not sock._exists.shared_exists
        for rnd in range(12):
            keys = hexkeys(24, tag=rnd)
            kv_n = rng.randrange(0, 25)
            ix_n = rng.randrange(0, 25)
            c.batch_set_v2([PoolTransfer("kv", pages(0, kv_n), keys=keys[:kv_n]),
                            PoolTransfer("indexer", pages(0, ix_n), keys=keys[:ix_n])])
            at = sorted(rng.sample(range(24), rng.randrange(0, 6)))
            c.batch_set_v2([PoolTransfer("mamba", torch.arange(len(at)),
                                         keys=[keys[i] for i in at])])
            sock.ping()  # the commits are read: c may answer from the table
            c.ping()
            for window in (1, 2):
                q = queries(keys, window)
                mine = answered_shared(c, lambda q=q, k=keys: c.batch_exists_v2(k, q))
                theirs = sock.batch_exists_v2(keys, q)
                assert mine == theirs, (rnd, window, kv_n, ix_n, at)
            assert answered_shared(c, lambda k=keys: c.batch_exists(k)) == \
                sock.batch_exists(keys) == kv_n
        # a pool this client never registered: the daemon's typed error, as before
        from hicached.errors import UnknownPool
        with pytest.raises(UnknownPool):
            c.batch_exists_v2(keys, [PoolTransfer("swa", keys=keys[:1],
                                                  hit_policy="trailing_pages")])


def test_own_writes_are_seen_and_other_namespaces_are_not(make_daemon):
    daemon = make_daemon(extra=["--l3-backend", "none"])  # (with L3, misses ask the daemon)
    with hybrid_client(daemon) as c, hybrid_client(daemon, "model-b") as other:
        for rnd in range(30):  # commits are not awaited: exists must still see them
            keys = hexkeys(8, tag=100 + rnd)
            c.batch_set_v2([PoolTransfer("kv", pages(0, 8), keys=keys)])
            assert c.batch_exists(keys) == 8
        # once the daemon acknowledged the commit in the table, no round trip is needed
        keys = hexkeys(8, tag=200)
        c.batch_set_v2([PoolTransfer("kv", pages(0, 8), keys=keys)])
        assert wait_until(lambda: c._conn.shared.view.read_up_to(c._conn.commits[0]))
        assert answered_shared(c, lambda: c.batch_exists(keys)) == 8
        keys = hexkeys(8, tag=100)
        assert answered_shared(c, lambda: c.batch_exists(keys)) == 8
        assert answered_shared(other, lambda: other.batch_exists(keys)) == 0
        c.flush("l2")
        assert answered_shared(c, lambda: c.batch_exists(keys)) == 0


def test_a_commit_after_its_reservation_expired_is_still_acknowledged(make_daemon):
    """Nothing of it is published, but the daemon read it: the client's later exists are
    answered from the table, not sent through the socket for want of the acknowledgement."""
    from hicached import protocol as P
    daemon = make_daemon(extra=["--l3-backend", "none", "--reservation-ttl-s", "0.5"])
    with hybrid_client(daemon) as c:
        keys = hexkeys(2, tag=300)
        res = c._conn.call(lambda s, r: P.Reserve(r, s, [P.PoolKeys("kv", keys)]))
        assert wait_until(lambda: c.stats()["expired_reservations"] == 1)
        c._conn.commits[0] += 1
        c._conn.send_only(P.Commit(0, c.session, res.reservation_id, [[True, True]], reply=False,
                              seq=c._conn.commits[0]))
        assert wait_until(lambda: c._conn.shared.view.read_up_to(c._conn.commits[0]))
        assert answered_shared(c, lambda: c.batch_exists(keys)) == 0  # nothing published
        assert c.stats()["l2_pages"] == 0


def test_tally_reaches_the_daemons_metrics(make_daemon):
    daemon, url = admin_daemon(make_daemon, extra=["--l3-backend", "none"])
    keys = hexkeys(16, tag=9)
    with hybrid_client(daemon) as c:
        c.batch_set_v2([PoolTransfer("kv", pages(0, 16), keys=keys)])
        c.ping()
        for _ in range(3):
            answered_shared(c, lambda: c.batch_exists(keys))

    def scraped():  # the tally is sent with the Bye
        m = scrape(url)
        try:
            return (sample(m, "hicached_requests_total", op="exists", outcome="shared"),
                    sample(m, "hicached_exists_keys_total", pool="kv"),
                    sample(m, "hicached_exists_hit_pages_total", pool="kv"))
        except KeyError:
            return None
    assert wait_until(lambda: scraped() == (3, 48, 48))


def test_tally_of_pools_never_registered_is_refused(make_daemon):
    """Pool names in a tally become metric labels: a client cannot make up new ones."""
    from hicached import protocol as P
    from hicached.errors import UnknownPool, UnknownSession
    daemon, url = admin_daemon(make_daemon, extra=["--l3-backend", "none"])
    with hybrid_client(daemon) as c:
        for session, keys, hits, error in (
                (c.session, {"kv": 1, "made-up": 5}, {}, UnknownPool),
                (c.session, {"kv": 1}, {"other": 5}, UnknownPool),
                (c.session ^ 1, {"kv": 1}, {"kv": 1}, UnknownSession)):
            with pytest.raises(error):  # fire and forget normally: asked here to see the error
                c._conn.call(lambda s, r: P.ExistsTally(r, session, 7, keys, hits))
        c._conn.send_only(P.ExistsTally(0, c.session, 2, {"kv": 4}, {"kv": 3}))  # a real one counts
        c.ping()
        m = scrape(url)
        assert sample(m, "hicached_requests_total", op="exists", outcome="shared") == 2
        assert sample(m, "hicached_exists_keys_total", pool="kv") == 4
        assert not any(label in str(m) for label in ("made-up", "other"))


def test_daemon_gone_or_restarted_or_table_off(make_daemon):
    daemon = make_daemon(extra=["--l3-backend", "none"])
    keys = hexkeys(8, tag=11)
    c = hybrid_client(daemon, timeout_s=1.0)
    try:
        c.batch_set_v2([PoolTransfer("kv", pages(0, 8), keys=keys)])
        assert c.batch_exists(keys) == 8
        daemon.stop(signal.SIGKILL)  # no CLOSED flag: the heartbeat goes stale
        age_heartbeat(daemon, STALE_S + 0.1)  # (as if that long passed)
        with pytest.raises(DaemonUnavailable):
            c.batch_exists(keys)
        daemon.start()  # a new daemon (new epoch, empty L2) at the same paths
        assert with_socket_calls(c, lambda: c.batch_exists(keys)) == (0, 1)  # joins it again
        assert answered_shared(c, lambda: c.batch_exists(keys)) == 0
        c.batch_set_v2([PoolTransfer("kv", pages(0, 8), keys=keys)])
        c.ping()
        assert answered_shared(c, lambda: c.batch_exists(keys)) == 8
    finally:
        c.close()
    off = make_daemon(name="off", extra=["--l3-backend", "none", "--no-shared-exists"])
    with hybrid_client(off) as c:
        assert c._conn.shared is None
        c.batch_set_v2([PoolTransfer("kv", pages(0, 8), keys=keys)])
        assert c.batch_exists(keys) == 8
    assert not os.path.exists(off.cfg.arena_path + ".presence")


def test_full_table_falls_back_to_the_socket_until_the_keys_fit(make_daemon):
    daemon = make_daemon(extra=["--l3-backend", "none", "--presence-slots", "16"])
    keys = hexkeys(24, tag=12)
    with hybrid_client(daemon) as c:
        c.batch_set_v2([PoolTransfer("kv", pages(0, 24), keys=keys)])  # 24 > 16 * MAX_LOAD
        c.ping()
        assert c._conn.shared.view.usable() is None
        assert with_socket_calls(c, lambda: c.batch_exists(keys)) == (24, 1)
        assert c.stats()["presence"] == {"slots": 16, "keys": 9, "full": True, "sessions": 1,
                                          "tag_grain": 65536}
        c.flush("l2")  # L2 empty: the next sweep (every 0.5 s) refills the table
        assert wait_until(lambda: c.stats()["presence"]["full"] is False)
        c.batch_set_v2([PoolTransfer("kv", pages(0, 4), keys=keys[:4])])
        c.ping()
        assert answered_shared(c, lambda: c.batch_exists(keys)) == 4
    out = daemon.output()
    assert "presence table full (9 keys in 16 slots)" in out
    assert out.count("presence table full") == 1  # once, though more keys came and went
    assert "over the socket" in out and "raise presence_slots (16 B a slot) above 16" in out
    assert "presence table rebuilt with 0 keys" in out


def test_tally_never_waits_for_another_threads_request(make_daemon):
    daemon = make_daemon(extra=["--l3-backend", "none"])
    keys = hexkeys(8, tag=13)
    with hybrid_client(daemon) as c:
        c.batch_set_v2([PoolTransfer("kv", pages(0, 8), keys=keys)])
        c.ping()
        held, done = threading.Event(), threading.Event()

        def hold():  # another thread in the middle of a long request holds the client's lock
            with c._conn.lock:
                held.set()
                done.wait(10)
        t = threading.Thread(target=hold)
        t.start()
        held.wait(5)
        c._conn.shared._tallied = 0.0  # a tally is due
        start = time.monotonic()
        assert c.batch_exists(keys) == 8
        assert time.monotonic() - start < 1.0 and c._conn.shared.tally_due()  # kept for later
        done.set()
        t.join()
        c.batch_exists(keys)
        assert not c._conn.shared.tally_due()  # sent now


WRITER_LOOP = """
import os, sys, time, torch
sys.path.insert(0, %r)
from pools import kv_pool, indexer_pool, pages
from hicached import Client, PoolTransfer
""" + RacingWriter.KEEP_UP + """
c = Client(sys.argv[1], "model-a")
c.register_mem_host_pool_v2(kv_pool(seed=1), "kv")
c.register_mem_host_pool_v2(indexer_pool(seed=3), "indexer")
end = time.monotonic() + float(sys.argv[2])
r = 0
out = os.open(sys.argv[3], os.O_RDWR)
while time.monotonic() < end:
    keep_up(out, r, 4, end)  # never far past the rounds the reader asks about
    os.pwrite(out, r.to_bytes(8, "little"), 0)  # the round being written, for the reader  # kv-only pages ("k...") and kv+indexer pages ("b...")
    ks = [f"k{r:07x}{i:08x}" for i in range(16)]
    bs = [f"b{r:07x}{i:08x}" for i in range(16)]
    c.batch_set_v2([PoolTransfer("kv", pages(0, 16), keys=ks)])
    c.batch_set_v2([PoolTransfer("kv", pages(16, 16), keys=bs),
                    PoolTransfer("indexer", pages(16, 16), keys=bs)])
    r += 1
print(r)
c.close()
"""


def test_readers_racing_evictions_never_see_another_keys_pools(make_daemon, tmp_path):
    """A writer process keeps a tiny arena evicting (the table half full: long probe runs, keys
    moved by every removal) while this process answers exists from the table: a kv-only page must
    never look like it has an indexer page (another key's mask), whatever the race."""
    daemon = make_daemon(l2_size="1MiB", slab_size="1MiB",
                         extra=["--l3-backend", "none", "--presence-slots", "2048"])
    checked = answered = present = 0
    with RacingWriter(WRITER_LOOP, daemon.endpoint, 4, tmp_path) as writer, \
            hybrid_client(daemon) as c:
        while time.monotonic() < writer.end:
            now = writer.round()
            writer.asked(now)
            r = max(0, now - random.randrange(8))
            key = f"k{r:07x}{random.randrange(16):08x}"  # a recent kv-only page (or evicted)
            res, calls = with_socket_calls(c, lambda k=key: c.batch_exists_v2(
                [k], [PoolTransfer("indexer", keys=[k], hit_policy="all_pages")]))
            assert res.kv_hit_pages == 0 and "indexer" not in res.extra_pool_hit_pages, key
            checked += 1
            answered += not calls
            present += res.extra_pool_hit_pages.get("kv", 0)
    assert writer.finish() > 10
    assert checked > 200 and answered > checked // 2  # mostly from the table
    assert present > checked // 4  # most asked about pages L2 held at that moment
