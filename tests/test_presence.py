"""The shared presence table (presence.py) and exists answered from it (shared_exists.py)."""

import os
import random
import signal
import threading
import time

import numpy as np
import pytest
import torch
import xxhash
from admin_helpers import admin_daemon, sample, scrape
from conftest import RacingWriter, wait_until
from pools import indexer_pool, kv_pool, mamba_pool, pages

from hicached import PoolTransfer
from hicached.errors import DaemonUnavailable
from hicached.ops.config import load_config
from hicached.presence import (
    F_CLOSED,
    H_FLAGS,
    H_MAGIC,
    KEY_BYTES,
    LOOKUP_SCALAR,
    MAX_LOAD,
    MIN_SLOTS,
    SESSION_WORDS,
    TABLE_WORD,
    TAG_GRAIN,
    PresenceTable,
    PresenceView,
    default_slots,
    fingerprint,
    fingerprint_list,
    fingerprints,
    namespace_seed,
    table_bytes,
)

SEED = namespace_seed("ns-test")


def hexkeys(n, tag=0, width=64):
    return [f"{tag:08x}{i:0{width - 8}x}" for i in range(n)]


# ---------------------------------------------------------------- fingerprints


def test_fingerprints_match_the_per_key_twin():
    rng = random.Random(1)
    for width in (8, 16, 40, 64, 128):
        keys = ["".join(rng.choice("0123456789abcdef-/:") for _ in range(width))
                for _ in range(300)]
        vec = fingerprints(SEED, keys)
        assert vec is not None and vec.dtype == np.uint64
        assert vec.tolist() == [fingerprint(SEED, k) for k in keys]
        assert len(set(vec.tolist())) == len(keys)  # no collision among distinct keys
    assert (fingerprints(SEED, hexkeys(64)) != fingerprints(namespace_seed("other"),
                                                            hexkeys(64))).all()
    assert fingerprints(SEED, []).size == 0
    assert min(fingerprint(s, "") for s in range(1000)) >= 2  # 0 (empty) and 1 never occur


def test_fingerprints_are_xxh3_of_any_str_key():
    """The daemon's and the clients' function, named by the table's MAGIC: XXH3-64 of the
    key's UTF-8 bytes under the namespace's seed, for keys of any length and characters."""
    rng = random.Random(2)
    chars = [chr(c) for c in range(128)] + ["é", "中", "\U0001f600"]
    keys = ["".join(rng.choices(chars, k=rng.randint(0, 80))) for _ in range(500)]
    seed = rng.getrandbits(64)
    vec = fingerprints(seed, keys)
    assert vec is not None and vec.shape == (500,)
    assert vec.tolist() == [fingerprint(seed, k) for k in keys]
    assert fingerprint_list(seed, keys) == vec.tolist()
    k = "0123abcd" * 8
    assert fingerprint(seed, k) == xxhash.xxh3_64_intdigest(k.encode(), seed)


@pytest.mark.parametrize("keys", [
    ["a" * 8, "b" * 8, 5],                   # not all str
    ["a" * 8, b"b" * 8],
    [None],
    ["\ud800"],                             # a lone surrogate: no UTF-8
])
def test_fingerprints_refuse_keys_that_are_not_str(keys):
    assert fingerprints(SEED, keys) is None
    assert fingerprint_list(SEED, keys) is None


def test_magic_names_the_fingerprint_function(tmp_path):
    """A table of another format (an older daemon's, whose fingerprints differ) is never read:
    its client asks the daemon."""
    path = f"/dev/shm/hicached-test-presence-{os.getpid()}-{time.monotonic_ns()}"
    t = PresenceTable(path, 64, epoch=3)
    try:
        view = PresenceView(path, 64, 3, SEED)
        assert view.usable() is not None
        t._w[H_MAGIC] = int.from_bytes(b"HCPRES01", "little")
        assert view.usable() is None and not view.alive()
    finally:
        t.close()


# ---------------------------------------------------------------- the table


@pytest.fixture
def table(tmp_path):
    path = f"/dev/shm/hicached-test-presence-{os.getpid()}-{time.monotonic_ns()}"
    t = PresenceTable(path, 64, epoch=7)
    yield t
    t.close()


def test_table_follows_sets_and_removes_with_collisions(table):
    """Random sets / removes on a 64-slot table (long probe runs, wrap-around) read back exactly
    through a reader's mapping after every step."""
    view = PresenceView(table.path, 64, 7, SEED)
    keys = hexkeys(200, width=16)
    fps = dict(zip(keys, fingerprints(SEED, keys).tolist(), strict=True))
    model: dict[str, int] = {}
    rng = random.Random(3)
    limit = int(64 * MAX_LOAD)
    for step in range(3000):
        key = rng.choice(keys)
        if key in model and rng.random() < 0.5:
            table.remove(fps[key])
            del model[key]
        elif key in model or len(model) < limit:
            model[key] = rng.randrange(1, 1 << 62)
            table.set(fps[key], model[key])
        if step % 50 == 0:
            masks = view.lookup(keys)
            assert masks.tolist() == [model.get(k, 0) for k in keys], step
            assert table.entries == len(model) == int(view.header[4])
    assert view.usable() is not None
    table.remove(fingerprint(SEED, "never-set"))  # removing what is absent changes nothing
    assert view.lookup(keys).tolist() == [model.get(k, 0) for k in keys]


def test_lookup_probes_alike_one_by_one_vectorised_and_in_its_tail():
    """Batches of 1 to 400 keys on a table at its fill limit (long probe runs): the scalar
    path (up to ``LOOKUP_SCALAR`` keys), the vectorised rounds and their scalar tail all read
    the model exactly."""
    path = f"/dev/shm/hicached-test-presence-{os.getpid()}-{time.monotonic_ns()}"
    t = PresenceTable(path, 1024, epoch=5)
    try:
        keys = hexkeys(1200)
        rng = random.Random(4)
        stored = rng.sample(keys, int(1024 * MAX_LOAD))
        model = {k: rng.randrange(1, 1 << 62) for k in stored}
        t.set_many(fingerprints(SEED, stored), np.array([model[k] for k in stored], np.int64))
        view = PresenceView(path, 1024, 5, SEED)
        for n in (1, 2, 17, LOOKUP_SCALAR, LOOKUP_SCALAR + 1, 150, 400):
            for _ in range(5):
                batch = rng.sample(keys, n)
                assert view.lookup(batch).tolist() == [model.get(k, 0) for k in batch], n
    finally:
        t.close()


class CheckedWords:
    """The table's words, checking after every store that each fp present sits beside its own
    mask (``model``: fp -> mask): what a reader racing a removal may find."""

    def __init__(self, words, model, slots):
        self.words, self.model, self.slots, self.stores = words, model, slots, 0

    def __getitem__(self, i):
        return self.words[i]

    def __setitem__(self, i, value):
        self.words[i] = value
        self.stores += 1
        for s in range(self.slots):
            fp = self.words[TABLE_WORD + 2 * s]
            if fp:
                assert self.words[TABLE_WORD + 2 * s + 1] == self.model[fp], (s, fp)


def test_removal_never_shows_an_fp_beside_another_keys_mask(table):
    keys = hexkeys(300, width=16)
    fps = fingerprints(SEED, keys).tolist()
    # keys homing in slots 3 and 4 (of 64): long runs that removals shift back
    near = [fp for fp in fps if fp & 63 in (3, 4)][:8] + [fp for fp in fps if fp & 63 == 5][:4]
    model = {fp: i + 1 for i, fp in enumerate(near)}
    for fp in near:
        table.set(fp, model[fp])
    table._w = checked = CheckedWords(table._w, model, 64)
    for fp in near[::2]:  # removals from the middle of the runs move the keys behind them
        table.remove(fp)
    assert checked.stores > 12  # keys were moved, every store checked
    view = PresenceView(table.path, 64, 7, SEED)
    found = view.table[:, 0].tolist()
    assert sorted(f for f in found if f) == sorted(near[1::2])


def test_a_full_table_is_rebuilt_once_the_keys_fit(table):
    items = list(zip(fingerprints(SEED, hexkeys(50)).tolist(), range(1, 51), strict=True))
    for fp, mask in items:
        table.set(fp, mask)
    assert table.overflowed and table.entries == int(64 * MAX_LOAD)
    view = PresenceView(table.path, 64, 7, SEED)
    assert view.usable() is None
    assert not table.rebuild(items)  # still too many: stays full
    assert table.overflowed and view.usable() is None
    assert table.rebuild(items[:10])
    assert not table.overflowed and view.usable() == 0 and table.entries == 10
    assert view.lookup(hexkeys(50)).tolist() == list(range(1, 11)) + [0] * 40


def test_table_overflow_closed_stale_and_other_epoch_are_not_usable(table):
    view = PresenceView(table.path, 64, 7, SEED)
    assert view.usable() == 0
    table.set_l3(True)
    assert view.usable() == 1
    table.beat(time.monotonic() - 5)  # a daemon stuck (or dead) for 5 s
    assert view.usable() is None
    table.beat(time.monotonic() + 5)  # a clock this client does not share
    assert view.usable() is None
    table.beat(time.monotonic())
    assert PresenceView(table.path, 64, 8, SEED).usable() is None  # another daemon's epoch
    for i, fp in enumerate(fingerprints(SEED, hexkeys(int(64 * MAX_LOAD) + 1)).tolist()):
        table.set(fp, 1)
    assert table.overflowed and view.usable() is None
    table.close()
    assert int(view.header[H_FLAGS]) & F_CLOSED and view.usable() is None
    assert not os.path.exists(table.path)


def test_session_words_acknowledge_commits(table):
    words = [table.take_session() for _ in range(SESSION_WORDS)]
    assert sorted(words) == list(range(SESSION_WORDS)) and table.take_session() == -1
    table.ack(words[5], 41)
    view = PresenceView(table.path, 64, 7, SEED, session=words[5])
    assert view.read_up_to(41) and not view.read_up_to(42)
    table.free_session(words[5])
    assert table.take_session() == words[5]  # handed out again, zeroed
    assert not view.read_up_to(1) and view.read_up_to(0)
    assert not PresenceView(table.path, 64, 7, SEED).read_up_to(0)  # no word: ask the socket


def test_bad_sizes_and_default_slots(tmp_path):
    with pytest.raises(ValueError, match="power of 2"):
        PresenceTable(f"/dev/shm/hicached-test-bad-{os.getpid()}", 100, 1)
    assert default_slots(1 << 30) == 1 << 19  # one key per 4 KiB at MAX_LOAD, rounded up
    assert default_slots(1 << 20) == 1 << 14 and default_slots(1 << 50) == 1 << 26


@pytest.mark.parametrize("l2_size", ["16MiB", "100MiB", "1GiB", "4GiB", "48GiB", "150GiB"])
def test_the_default_table_holds_an_arena_full_of_small_pages(l2_size, tmp_path):
    """A million 4 KiB pages in a 4 GiB arena stay answered from shared memory (issue 24): the
    daemon's default (``Daemon._presence_table``) fits ``l2_size // KEY_BYTES`` keys, for about
    1% of the arena."""
    config = load_config(None, {}, {"l2_size": l2_size, "slab_size": "1MiB",
                                    "state_dir": str(tmp_path)})
    assert config.presence_slots == 0
    slots = default_slots(config.l2_size)
    assert int(slots * MAX_LOAD) >= config.l2_size // KEY_BYTES
    assert slots * MAX_LOAD < 2 * config.l2_size // KEY_BYTES or slots == MIN_SLOTS
    nbytes = table_bytes(slots, config.l2_size)
    assert nbytes == (TABLE_WORD + 2 * slots + config.l2_size // TAG_GRAIN) * 8
    assert nbytes < 0.017 * config.l2_size or slots == MIN_SLOTS


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
    real = c._call
    c._call = lambda *a, **k: calls.append(a) or real(*a, **k)
    try:
        return fn(), len(calls)
    finally:
        del c._call


def answered_shared(c, fn):
    """``fn()``'s result, asserting the client answered it from the table (no round trip)."""
    out, calls = with_socket_calls(c, fn)
    assert not calls, "exists went through the socket"
    return out


def test_shared_answers_equal_the_daemons_over_random_holes(make_daemon):
    daemon = make_daemon(extra=["--l3-backend", "none"])
    rng = random.Random(5)
    with hybrid_client(daemon) as c, hybrid_client(daemon, shared_exists=False) as sock:
        assert c._shared is not None and not sock._shared_exists
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
        assert wait_until(lambda: c._shared.view.read_up_to(c._commits[0]))
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
        res = c._call(lambda s, r: P.Reserve(r, s, [P.PoolKeys("kv", keys)]))
        assert wait_until(lambda: c.stats()["expired_reservations"] == 1)
        c._commits[0] += 1
        c._send_only(P.Commit(0, c.session, res.reservation_id, [[True, True]], reply=False,
                              seq=c._commits[0]))
        assert wait_until(lambda: c._shared.view.read_up_to(c._commits[0]))
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
                c._call(lambda s, r: P.ExistsTally(r, session, 7, keys, hits))
        c._send_only(P.ExistsTally(0, c.session, 2, {"kv": 4}, {"kv": 3}))  # a real one counts
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
        time.sleep(1.2)
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
        assert c._shared is None
        c.batch_set_v2([PoolTransfer("kv", pages(0, 8), keys=keys)])
        assert c.batch_exists(keys) == 8
    assert not os.path.exists(off.cfg.arena_path + ".presence")


def test_full_table_falls_back_to_the_socket_until_the_keys_fit(make_daemon):
    daemon = make_daemon(extra=["--l3-backend", "none", "--presence-slots", "16"])
    keys = hexkeys(24, tag=12)
    with hybrid_client(daemon) as c:
        c.batch_set_v2([PoolTransfer("kv", pages(0, 24), keys=keys)])  # 24 > 16 * MAX_LOAD
        c.ping()
        assert c._shared.view.usable() is None
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
            with c._lock:
                held.set()
                done.wait(10)
        t = threading.Thread(target=hold)
        t.start()
        held.wait(5)
        c._shared._tallied = 0.0  # a tally is due
        start = time.monotonic()
        assert c.batch_exists(keys) == 8
        assert time.monotonic() - start < 1.0 and c._shared.tally_due()  # kept for later
        done.set()
        t.join()
        c.batch_exists(keys)
        assert not c._shared.tally_due()  # sent now


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
