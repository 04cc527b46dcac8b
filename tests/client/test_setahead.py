"""Set-ahead slots: a set copies its pages into slots granted by the answer to the previous set
while its Reserve travels; the daemon binds them to new keys and keeps them for keys it has.

Unit tests of the index and lease-table side, then real daemons on ipc:// sockets: bytes always
read back right (also by another client), a stored page is never overwritten through a slot,
slots die with their TTL, their client and their daemon, and bounds and quotas hold."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from test_speculative import TOKENS, page, pool, tokens

from hicached import HostPool, PoolTransfer
from hicached import protocol as P
from hicached.daemon.index import PageIndex
from hicached.daemon.leases import LeaseTable
from hicached.daemon.slabs import SlabAllocator
from hicached.errors import ProtocolError

PAGE = 128 * 1024  # test_speculative's pool: 16 tokens * 4 layers * 512 * 4 bytes
MIB = 1 << 20


# ---------------------------------------------------------------- index and lease table


def test_unbound_slot_is_pinned_counted_and_bound_with_a_new_generation():
    index = PageIndex(SlabAllocator(4 * MIB, MIB))
    e = index.reserve_unbound("ns", MIB)
    assert e is not None and e.key == "" and e.pins == 1
    assert index.ns_bytes["ns"] == MIB and index.alloc.slab_of(e.offset).pinned == 1
    gen = e.gen
    index.bind(e, ("ns", "kv"), "k", MIB - 64)
    assert index.get_pending(("ns", "kv"), "k") is e and e.gen != gen
    index.commit(e)
    assert index.get(("ns", "kv"), "k") == e and e.pins == 0
    other = index.reserve_unbound("ns", MIB)
    index.abort(other)  # an unbound slot is freed like a pending one
    assert index.ns_bytes["ns"] == MIB and other.offset == -1


def test_eviction_never_takes_an_unbound_slot():
    index = PageIndex(SlabAllocator(2 * MIB, MIB))
    held = index.reserve_unbound("ns", MIB)
    page = index.reserve(("ns", "kv"), "k", MIB, MIB)
    index.commit(page)
    assert index.reserve(("ns", "kv"), "k2", MIB, MIB) is not None  # evicts the committed page
    assert index.get(("ns", "kv"), "k") is None
    assert index.reserve(("ns", "kv"), "k3", MIB, MIB) is None  # the unbound slot stays
    assert held.offset >= 0 and held.pins == 1


def test_lease_table_expires_and_drops_set_ahead_slots():
    index = PageIndex(SlabAllocator(8 * MIB, MIB))
    leases = LeaseTable(index, reservation_ttl_s=10.0, lease_ttl_s=10.0)
    a = leases.ahead_of(7, now=0.0)
    for _ in range(3):
        leases.add_ahead(a, "kv", index.reserve_unbound("ns", MIB))
    assert leases.ahead_bytes == 3 * MIB and a.nbytes == 3 * MIB
    first = next(iter(a.pools["kv"]))
    assert leases.take_ahead(a, "kv", first) is not None
    assert leases.take_ahead(a, "kv", first) is None  # only once
    assert leases.take_ahead(a, "mamba", first) is None
    assert leases.free_ahead(a, "kv", keep=1) == 1 and len(a.pools["kv"]) == 1
    leases.sweep(5.0)
    assert 7 in leases.ahead  # not yet
    leases.sweep(10.0)
    assert 7 not in leases.ahead and leases.ahead_bytes == 0
    # the expired slot is fenced (its client may be copying into it) for one more TTL
    assert leases.fenced_bytes == MIB and index.ns_bytes["ns"] == 2 * MIB
    leases.sweep(19.0)
    assert leases.fenced_bytes == MIB
    leases.sweep(20.0)
    assert leases.fenced_bytes == 0 and index.ns_bytes["ns"] == MIB  # the taken one only
    b = leases.ahead_of(8, now=20.0)
    leases.add_ahead(b, "kv", index.reserve_unbound("ns", MIB))
    leases.drop_session(8)
    assert leases.ahead_bytes == 0 and index.ns_bytes["ns"] == MIB
    c = leases.ahead_of(9, now=20.0)
    leases.add_ahead(c, "kv", index.reserve_unbound("ns", MIB))
    leases.sweep(30.0)
    assert leases.fenced_bytes == MIB
    leases.drop_session(9)  # its session ended: no one can write it now
    assert leases.fenced_bytes == 0 and index.ns_bytes["ns"] == MIB


def test_expired_reservation_frees_its_keys_at_once_and_its_slots_after_a_fence():
    """A client stalled in the middle of its copy may still write the slots of its expired
    reservation: nobody else gets them before the fence ends, or before that client's late
    commit (its copy is over) or the end of its session."""
    index = PageIndex(SlabAllocator(4 * MIB, MIB))
    leases = LeaseTable(index, reservation_ttl_s=10.0, lease_ttl_s=10.0)
    runs = []
    for session, key in ((1, "a"), (1, "b"), (2, "c")):
        r = leases.new_reservation(session, now=0.0)
        e = index.reserve(("ns", "kv"), key, MIB, MIB)
        r.slots.append((0, 0, e))
        runs.append((r, e))
    assert index.reserve(("ns", "kv"), "d", MIB, MIB) is not None  # the 4th slot
    assert leases.sweep(10.0) == (3, 0)
    assert leases.fenced_bytes == 3 * MIB and not leases.reservations
    # keys are free now: another writer may reserve them, but there is no slot to give
    assert index.get_pending(("ns", "kv"), "a") is None
    assert index.reserve(("ns", "kv"), "a", MIB, MIB) is None  # arena full: all fenced/pinned
    (ra, ea), (_, eb), (_, ec) = runs
    assert leases.take_reservation(ra.id, 2) is None and leases.fenced_bytes == 3 * MIB  # foreign
    assert leases.take_reservation(ra.id, 1) is None  # its late commit: the fence ends
    assert leases.fenced_bytes == 2 * MIB and ea.offset == -1
    assert index.reserve(("ns", "kv"), "a", MIB, MIB) is not None
    leases.drop_session(2)
    assert leases.fenced_bytes == MIB and ec.offset == -1
    leases.sweep(19.9)
    assert eb.offset >= 0
    leases.sweep(20.0)
    assert leases.fenced_bytes == 0 and eb.offset == -1 and not leases.fences


def test_a_session_that_leaves_alive_fences_what_its_threads_may_still_write():
    """Bye or a new handshake of a live client: its reservations and set-ahead slots are fenced
    (another thread may be copying into them), until the TTL or until its process exits; a
    replaced session's leases run to their TTL (a thread may be reading)."""
    from hicached.liveness import identify, own_pid_ns
    index = PageIndex(SlabAllocator(8 * MIB, MIB))
    leases = LeaseTable(index, reservation_ttl_s=10.0, lease_ttl_s=10.0)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        me = identify(proc.pid, 0, 0, 0, own_pid_ns())
        for session in (1, 2):
            r = leases.new_reservation(session, now=0.0)
            r.slots.append((0, 0, index.reserve(("ns", "kv"), f"r{session}", MIB, MIB)))
            a = leases.ahead_of(session, now=0.0)
            leases.add_ahead(a, "kv", index.reserve_unbound("ns", MIB))
            committed = index.reserve(("ns", "kv"), f"c{session}", MIB, MIB)
            index.commit(committed)
            leases.new_lease(session, [committed], now=0.0)
        leases.drop_session(1, now=1.0, process=me)  # Bye
        assert leases.fenced_bytes == 2 * MIB
        assert [g.session for g in leases.leases.values()] == [2]  # its lease ended
        leases.drop_session(2, now=1.0, keep_leases=True, process=me)  # replaced
        assert leases.fenced_bytes == 4 * MIB
        assert [g.session for g in leases.leases.values()] == [2]  # kept: a thread may read
        assert leases.ahead_bytes == 0 and not leases.reservations
        leases.sweep(2.0)
        assert leases.fenced_bytes == 4 * MIB  # the process lives: fenced
        proc.kill()
        proc.wait()
        leases.sweep(3.0)  # it is gone: nobody can write them now
        assert leases.fenced_bytes == 0 and not leases.fences
        assert index.ns_bytes["ns"] == 2 * MIB  # the two committed pages
        leases.sweep(10.0)
        assert not leases.leases  # the replaced session's lease, at its TTL
    finally:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------- real daemons


@pytest.fixture
def daemon(make_daemon):
    return make_daemon(l2_size="32MiB", extra=["--l3-backend", "none"])


def record(client):
    """Capture every Reserved answer the client gets."""
    answers = []
    original = client._conn.roundtrip

    def roundtrip(msg, *a, **kw):
        res = original(msg, *a, **kw)
        if isinstance(res, P.Reserved):
            answers.append((msg, res))
        return res
    client._conn.roundtrip = roundtrip
    return answers


def put(client, host, keys, first_page=0):
    client.register_mem_host_pool_v2(host, "kv")
    res = client.batch_set_v2([PoolTransfer("kv", tokens(first_page, len(keys)), keys=keys)])
    client.ping()  # the fire-and-forget commit has landed
    return res["kv"]


def read(client, keys, num_pages=8):
    dst = pool(num_pages=num_pages)
    client.register_mem_host_pool_v2(dst, "kv")
    hits = client.batch_get_v2([PoolTransfer("kv", tokens(0, len(keys)), keys=keys)])["kv"]
    return hits, dst


def held(client):
    return len(client._ahead.slots.get("kv", ([],))[0])


def test_second_set_copies_into_granted_slots_and_reads_back(daemon):
    src = pool(seed=1)
    with daemon.client() as c, daemon.client(namespace="model-a") as reader:
        answers = record(c)
        assert put(c, src, ["a0", "a1", "a2", "a3"]) == [True] * 4
        assert held(c) == 4 and not answers[0][1].bound  # first set: nothing to name yet
        granted = answers[0][1].ahead[0]
        assert put(c, src, ["b0", "b1", "b2", "b3"], first_page=4) == [True] * 4
        msg, res = answers[1]
        assert msg.ahead == [granted] and res.bound == [[True] * 4]
        assert res.offsets == [granted]  # the keys got the very slots they were copied into
        assert c.stats()["set_ahead_slots"] == 4  # granted again
        hits, dst = read(reader, ["a0", "a1", "a2", "a3", "b0", "b1", "b2", "b3"])
        assert hits == [True] * 8
        assert torch.equal(dst.kv_buffer, src.kv_buffer)


def test_stored_keys_keep_their_page_and_the_slot_stays_set_ahead(daemon):
    first, second = pool(seed=2), pool(seed=3)
    with daemon.client() as c1, daemon.client() as c2:
        put(c1, first, ["x0", "x1"])
        answers = record(c2)
        put(c2, second, ["y0", "y1"])  # c2 now holds two slots
        granted = answers[0][1].ahead[0]
        # c2 sets x0 (stored by c1) and a new key: x0's page goes into a set-ahead slot, but
        # the daemon keeps c1's page and leaves that slot c2's
        assert put(c2, second, ["x0", "z1"], first_page=2) == [True, True]
        msg, res = answers[1]
        assert msg.ahead == [granted]
        assert res.offsets[0][0] == P.SLOT_PRESENT and res.bound == [[False, True]]
        assert granted[0] in res.ahead[0]
        hits, dst = read(c1, ["x0", "x1", "z1"])
        assert hits == [True] * 3
        assert torch.equal(page(dst, 0), page(first, 0)), "a stored page was overwritten"
        assert torch.equal(page(dst, 2), page(second, 3))


def test_slots_follow_the_batch_size_and_the_bounds(make_daemon):
    d = make_daemon(l2_size="32MiB", extra=["--l3-backend", "none", "--set-ahead-bytes", "512KiB"])
    src = pool(seed=4)
    with d.client() as c, d.client(set_ahead_bytes=0) as off, d.client() as c3:
        put(c, src, [f"k{i}" for i in range(8)])
        assert held(c) == 4  # the daemon's 512 KiB per client
        put(c, src, ["m0", "m1"])
        assert held(c) == 4  # fewer needed: kept (as many as the client asked before)
        put(off, src, [f"o{i}" for i in range(8)])
        assert held(off) == 0 and not off._ahead.slots
        put(c3, src, [f"p{i}" for i in range(8)])
        # all clients together hold at most an eighth of the arena (32 MiB / 8 = 4 MiB)
        assert c.stats()["set_ahead_bytes"] <= 4 * MIB
        hits, dst = read(c3, [f"p{i}" for i in range(8)])
        assert hits == [True] * 8 and torch.equal(dst.kv_buffer, src.kv_buffer)
    with d.client() as probe:
        assert probe.stats()["set_ahead_slots"] == 0  # closed clients gave theirs back


def test_small_pages_take_no_set_ahead(daemon):
    with daemon.client() as c:
        small = HostPool.allocate_mla(8, 1, 1, 32, dtype=torch.bfloat16)  # 64-byte pages
        c.register_mem_host_pool_v2(small, "kv")
        c.batch_set_v2([PoolTransfer("kv", torch.arange(8), keys=[f"s{i}" for i in range(8)])])
        assert not c._ahead.slots and c.stats()["set_ahead_slots"] == 0


def test_a_request_cannot_bind_slots_it_was_not_granted(daemon):
    src = pool(seed=5)
    with daemon.client() as owner, daemon.client(namespace="model-b") as thief:
        put(owner, src, ["o0", "o1"])
        stolen = owner._ahead.slots["kv"][0]
        thief.register_mem_host_pool_v2(pool(), "kv")
        res = thief._conn.call(lambda s, r: P.Reserve(r, s, [P.PoolKeys("kv", ["t0", "t1"])],
                                                 [stolen], [0]))
        assert not res.bound and all(off not in stolen for off in res.offsets[0])
        thief._sets.abort(res.reservation_id)
        # naming slots without saying how many to hold keeps the rest
        mine = owner._ahead.slots["kv"][0]
        res = owner._conn.call(lambda s, r: P.Reserve(r, s, [P.PoolKeys("kv", ["n0"])], [mine[:1]]))
        assert res.bound == [[True]] and res.ahead == [mine[1:]]
        owner._sets.abort(res.reservation_id)
        owner._ahead.slots["kv"] = (mine[1:], *owner._ahead.slots["kv"][1:])
        # one slot named for two keys: refused whole (neither page would be intact)
        mine = owner._ahead.slots["kv"][0]
        with pytest.raises(ProtocolError, match="twice"):
            owner._conn.call(lambda s, r: P.Reserve(r, s, [P.PoolKeys("kv", ["d0", "d1"])],
                                               [[mine[0], mine[0]]], [2]))
        # the owner's next set still uses the slot it holds (one left of two)
        answers = record(owner)
        put(owner, src, ["o2", "o3"], first_page=2)
        assert answers[0][1].bound == [[True, False]] and len(answers[0][1].ahead[0]) == 2
        hits, dst = read(owner, ["o0", "o1", "o2", "o3"])
        assert hits == [True] * 4 and torch.equal(dst.kv_buffer[:4 * TOKENS],
                                                  src.kv_buffer[:4 * TOKENS])


def test_old_slots_are_not_used_and_expire(make_daemon):
    d = make_daemon(l2_size="32MiB", extra=["--l3-backend", "none", "--reservation-ttl-s", "1"])
    src = pool(seed=6)
    with d.client() as c:
        answers = record(c)
        put(c, src, ["e0", "e1"])
        time.sleep(0.6)  # more than half the TTL: the client must not write into them
        put(c, src, ["e2", "e3"], first_page=2)
        assert answers[1][0].ahead == [[]] and not answers[1][1].bound
        deadline = time.monotonic() + 10
        while c.stats()["set_ahead_slots"] and time.monotonic() < deadline:
            time.sleep(0.2)  # no set for a TTL: the daemon frees them
        assert c.stats()["set_ahead_slots"] == 0
        hits, dst = read(c, ["e0", "e1", "e2", "e3"])
        assert hits == [True] * 4 and torch.equal(dst.kv_buffer[:4 * TOKENS],
                                                  src.kv_buffer[:4 * TOKENS])


def test_killed_client_gives_its_slots_back(daemon):
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = (
        f"import sys, torch; sys.path.insert(0, {repo!r})\n"
        "from hicached import Client, HostPool, PoolTransfer\n"
        f"c = Client({daemon.endpoint!r}, 'model-a')\n"
        "p = HostPool.allocate_mla(4, 16, 4, 512, dtype=torch.float32)\n"
        "c.register_mem_host_pool_v2(p, 'kv')\n"
        "c.batch_set_v2([PoolTransfer('kv', torch.arange(64), keys=['q0','q1','q2','q3'])])\n"
        "print('held', flush=True)\n"
        "import time; time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        with daemon.client() as probe:
            assert probe.stats()["set_ahead_slots"] == 4
            child.send_signal(signal.SIGKILL)
            child.wait(10)
            deadline = time.monotonic() + 15
            while probe.stats()["set_ahead_slots"] and time.monotonic() < deadline:
                time.sleep(0.2)
            assert probe.stats()["set_ahead_slots"] == 0
    finally:
        child.kill()
        child.wait()
        child.stdout.close()


def test_daemon_restart_voids_the_slots(make_daemon, tmp_path):
    d = make_daemon(l2_size="32MiB", extra=["--l3-backend", "none"])
    src = pool(seed=7)
    c = d.client()
    try:
        put(c, src, ["r0", "r1"])
        assert held(c) == 2
        d.stop()
        d.start()
        answers = record(c)
        assert put(c, src, ["r2", "r3"], first_page=2) == [True, True]  # joins again
        assert not answers[-1][1].bound  # the old daemon's slots were never named
        hits, dst = read(c, ["r2", "r3"])
        assert hits == [True, True] and torch.equal(dst.kv_buffer[:2 * TOKENS],
                                                    src.kv_buffer[2 * TOKENS:4 * TOKENS])
    finally:
        c.close()


def test_threads_sharing_a_client_never_share_a_slot(daemon):
    src = pool(seed=8, num_pages=64)
    errors = []
    with daemon.client() as c:
        c.register_mem_host_pool_v2(src, "kv")

        def writer(t):
            try:
                for r in range(6):
                    first = (t * 6 + r) % 60
                    keys = [f"t{t}-{r}-{i}" for i in range(4)]
                    res = c.batch_set_v2([PoolTransfer("kv", tokens(first, 4), keys=keys)])
                    assert all(res["kv"])
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
        threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        c.ping()
        for t in range(4):
            for r in range(6):
                first = (t * 6 + r) % 60
                keys = [f"t{t}-{r}-{i}" for i in range(4)]
                dst = pool(num_pages=64)
                c.register_mem_host_pool_v2(dst, "kv")
                hits = c.batch_get_v2([PoolTransfer("kv", tokens(first, 4), keys=keys)])["kv"]
                assert hits == [True] * 4
                span = slice(first * TOKENS, (first + 4) * TOKENS)
                assert torch.equal(dst.kv_buffer[span], src.kv_buffer[span]), (t, r)


def test_set_ahead_slots_count_for_the_quota_and_never_evict_for_it(make_daemon):
    d = make_daemon(l2_size="32MiB",
                    extra=["--l3-backend", "none", "--namespace-quotas", '{"model-a": "1MiB"}'])
    src = pool(seed=9)
    with d.client() as c:
        assert put(c, src, [f"q{i}" for i in range(4)]) == [True] * 4  # 512 KiB stored
        assert c.stats()["set_ahead_slots"] == 4  # the rest of the 1 MiB quota
        assert put(c, src, [f"w{i}" for i in range(8)]) == [True] * 8
        # 4 pages went into the slots, 4 evicted the namespace's own oldest pages; no slot is
        # granted again, since that would evict pages only to hold idle slots
        assert c.stats()["set_ahead_slots"] == 0
        assert read(c, [f"q{i}" for i in range(4)])[0] == [False] * 4
        hits, dst = read(c, [f"w{i}" for i in range(8)])
        assert hits == [True] * 8 and torch.equal(dst.kv_buffer, src.kv_buffer)
        assert put(c, src, ["x0"]) == [True]  # evicts its own oldest page, still no slot
        assert c.stats()["set_ahead_slots"] == 0


def test_metrics_and_stats_show_the_held_slots(make_daemon):
    from admin_helpers import admin_daemon, http, sample, scrape

    d, url = admin_daemon(make_daemon, l2_size="32MiB", extra=["--l3-backend", "none"])
    with d.client() as c:
        put(c, pool(seed=10), ["s0", "s1", "s2"])
        assert sample(scrape(url), "hicached_set_ahead_bytes") == 3 * PAGE
        status, stats = http("GET", url + "/stats")
        assert status == 200 and stats["tiers"]["l2"]["set_ahead_slots"] == 3
    assert sample(scrape(url), "hicached_set_ahead_bytes") == 0  # the client left


@pytest.mark.parametrize("path", ["native", "pointer", "flat", "tensors"])
def test_every_copy_path_sets_ahead_and_reads_back(daemon, path):
    from test_hostpool import FlatOnly, PointerOnly

    src = pool(seed=11)
    with daemon.client() as c, daemon.client() as reader:
        answers = record(c)
        wrapped = {"native": src, "pointer": PointerOnly(src), "flat": FlatOnly(src),
                   "tensors": src}[path]
        c.register_mem_host_pool_v2(wrapped, "kv")
        for first, names in ((0, ["p0", "p1", "p2"]), (3, ["p3", "p4", "p5"])):
            if path == "tensors":  # SGLang's v0 path: one flat tensor per page
                flat = [page(src, first + i).contiguous().view(-1) for i in range(3)]
                assert c.batch_set_pages("kv", names, flat) == [True] * 3
            else:
                res = c.batch_set_v2([PoolTransfer("kv", tokens(first, 3), keys=names)])
                assert res["kv"] == [True] * 3
        c.ping()
        assert answers[1][1].bound == [[True] * 3]  # the second set went into its slots
        hits, dst = read(reader, [f"p{i}" for i in range(6)])
        assert hits == [True] * 6
        assert torch.equal(dst.kv_buffer[:6 * TOKENS], src.kv_buffer[:6 * TOKENS])
