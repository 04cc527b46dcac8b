"""An adversarial client against a real daemon: raw DEALER sockets speaking the protocol with
messages no ``Client`` would send (forged sessions and ids, foreign reservations and leases,
absurd numbers, truncated and mutated frames, out-of-order and duplicated requests, abandoned
sessions). After each round the daemon must be alive, a well-behaved client must store and read
pages byte-exact, nothing the attacks held may stay held, and the daemon must log no internal
error. Seeded (``FUZZ_SEEDS=1,2,...`` picks others): the seed fixes the requests sent, though
not exactly which answers (ids to reuse) have arrived when the next one is built."""

import os
import random
import time

import msgspec
import pytest
import torch
from conftest import raw_socket, wait_until
from pools import kv_pool, mamba_pool, pages

from hicached import PoolHitPolicy, PoolTransfer
from hicached import protocol as P

KV_PAGE_BYTES = 1024  # kv_pool's pages
BIG_PAGE_BYTES = 256 << 10  # past presence.TAG_GRAIN: slot tags, set-ahead slots
MAMBA_PAGE_BYTES = 112  # mamba_pool's states
BIG = (1 << 64) - 1
INTS = (0, 1, -1, 2, 7, 4096, 1 << 31, 1 << 62, (1 << 63) - 1, -(1 << 63), BIG)


class Adversary:
    """One raw connection: a session (maybe several), and what the daemon told it."""

    def __init__(self, endpoint: str, rng: random.Random, namespace: str = "model-a"):
        self.rng = rng
        self.ctx_sock = raw_socket(endpoint, timeout_ms=3000)
        self.sock = self.ctx_sock.__enter__()
        self.req = 1000
        self.sessions: list[int] = []
        self.reservations: list[int] = [0, 1, 2]
        self.leases: list[int] = [0, 1, 2]
        self.shapes: list[tuple[int, list[int]]] = []  # reservations held: (id, keys per pool)
        self.offsets: list[int] = [0, 64, 1 << 20]
        self.namespace = namespace

    def close(self) -> None:
        self.ctx_sock.__exit__(None, None, None)

    def next_id(self) -> int:
        self.req += 1
        return self.req

    def send(self, msg) -> None:
        self.sock.send(msg if isinstance(msg, bytes) else P.encode(msg))

    def answers(self, wait_ms: int = 0) -> list:
        """Every answer that arrived (waiting up to ``wait_ms`` for the first)."""
        out = []
        if wait_ms and not self.sock.poll(wait_ms):
            return out
        while self.sock.poll(0):
            ans = P.answer_decoder.decode(self.sock.recv())  # the daemon's answers always decode
            self.learn(ans)
            out.append(ans)
        return out

    def ask(self, msg):
        """Send and wait for the answer to this request (others are learnt from)."""
        self.send(msg)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            for ans in self.answers(wait_ms=100):
                if ans.req_id == msg.req_id:
                    return ans
        raise AssertionError(f"no answer to {msg!r}")

    def learn(self, ans) -> None:
        match ans:
            case P.Welcome():
                self.sessions.append(ans.session)
            case P.Reserved():
                self.reservations.append(ans.reservation_id)
                if ans.reservation_id:
                    self.shapes.append((ans.reservation_id, [len(row) for row in ans.offsets]))
                self.offsets += [o for row in ans.offsets for o in row if o >= 0]
                self.offsets += [o for row in ans.ahead for o in row]
            case P.Leased():
                self.leases.append(ans.lease_id)
                self.offsets += [o for row in ans.offsets for o in row if o >= 0]

    def hello(self, namespace: str | None = None, replaces: int = 0) -> int:
        w = self.ask(P.Hello(self.next_id(), P.PROTOCOL_VERSION, namespace or self.namespace,
                             os.getpid(), "fuzz", replaces=replaces))
        assert isinstance(w, P.Welcome), w
        return w.session

    # ------------------------------------------------------------ random messages

    def pick(self, seq):
        return seq[self.rng.randrange(len(seq))]

    def session(self, others: list[int]) -> int:
        r = self.rng.random()
        if r < 0.8 and self.sessions:
            return self.sessions[0]  # its pools are registered
        if r < 0.9 and self.sessions:
            return self.pick(self.sessions)
        if r < 0.95 and others:
            return self.pick(others)  # another connection's session
        return self.pick(INTS)

    def key(self) -> str:
        r = self.rng.random()
        if r < 0.9:
            return f"k{self.rng.randrange(120)}"  # few keys: collisions with everyone
        if r < 0.95:
            return "x" * self.rng.choice((0, P.MAX_KEY_LEN, P.MAX_KEY_LEN + 1, 5000))
        return self.pick(("", "\0", "../../etc", "h-abc", "é" * 300, "k1\0k2", "\U0001f600"))

    def pool(self) -> str:
        return self.pick(("kv",) * 6 + ("mamba",) * 3 + ("nope", "", "x" * 300))

    def keys(self) -> list[str]:
        return [self.key() for _ in range(self.pick((0, 1, 2, 5, 20)))]

    def transfers(self) -> list[P.PoolKeys]:
        return [P.PoolKeys(self.pool(), self.keys()) for _ in range(self.pick((0, 1, 2, 3)))]

    def ints(self, pool=None) -> list[int]:
        pool = pool or INTS
        return [self.pick(pool) for _ in range(self.pick((0, 1, 3, 8)))]

    def random_request(self, others: list[int]):
        rng, sid, rid = self.rng, self.session(others), self.next_id()

        def rows() -> list[list[bool]]:
            return [[rng.random() < 0.7 for _ in range(rng.randrange(6))]
                    for _ in range(rng.randrange(4))]
        kind = rng.choice((0, 1, 2, 3, 3, 3, 4, 4, 4, 5, 5, 5, 6, 6, 7, 8, 9, 10, 11, 12, 13, 14,
                           15))
        match kind:
            case 0:
                return P.Hello(rid, self.pick((P.PROTOCOL_VERSION,) * 5 + (0, 3, 5, BIG)),
                               self.pick((self.namespace,) * 4 + ("", "model-b")),
                               self.pick((os.getpid(), 0, -1, 1, BIG)), "fuzz",
                               replaces=self.pick([0, *self.sessions, *others]))
            case 1:
                return P.RegisterPool(rid, sid, self.pool(),
                                      self.pick((KV_PAGE_BYTES, 1, 0, -1, 4096, 1 << 40, BIG)))
            case 2:
                queries = [P.PoolQuery(self.pool(), self.pick(("all_pages", "trailing_pages",
                                                               "bogus")),
                                       self.pick((1, 2, 0, -1, 1 << 62, BIG)))
                           for _ in range(rng.randrange(3))]
                return P.Exists(rid, sid, self.keys(), queries, self.pool(),
                                release=self.ints(self.leases))
            case 3:
                return P.Reserve(rid, sid, self.transfers(),
                                 [self.ints(self.offsets + [-1]) for _ in range(rng.randrange(3))],
                                 self.ints((0, 1, 4, -1, 1 << 40, BIG)),
                                 release=self.ints(self.leases))
            case 4:
                if self.shapes and rng.random() < 0.7:  # a reservation it holds: mostly ok
                    res_id, shape = self.shapes.pop(rng.randrange(len(self.shapes)))
                    return P.Commit(rid, sid, res_id, [[rng.random() < 0.9 for _ in range(n)]
                                                      for n in shape], reply=rng.random() < 0.5)
                return P.Commit(rid, sid, self.pick(self.reservations + [BIG, -1]), rows(),
                                abort=rng.random() < 0.2, reply=rng.random() < 0.7,
                                seq=self.pick((0, 1, 5, BIG, -1)))
            case 5:
                return P.Lease(rid, sid, self.transfers(), stream=rng.random() < 0.5,
                               load=rng.random() < 0.7, release=self.ints(self.leases))
            case 6:
                touched = [v for o in self.ints(self.offsets) for v in (o, self.pick(INTS))]
                return P.Release(rid, sid, self.ints(self.leases + list(INTS)), touched,
                                 self.pick((0, 1, 1 << 40)))
            case 7:
                return P.ExistsTally(rid, sid, 1, {self.pool(): 3}, {self.pool(): 1})
            case 8:
                # forged, or a later session of its own (the first ones of all go on)
                return P.Bye(rid, self.pick([*INTS, *self.sessions[1:]]))
            case 9:
                # (a real flush empties L2 for everyone, the well-behaved client's pages too)
                return P.Flush(rid, self.pick(("bogus", "L2", "")))
            case 10:
                return P.GetBackend(rid)
            case 11:
                return P.GetStats(rid)
            case 12:
                return P.Ping(rid)
            case 15:
                return P.WaitStored(rid, sid, self.transfers(), self.pick((0.05, 0.3, 1.0)))
            case 13:  # a valid request's bytes, mangled
                raw = bytearray(P.encode(self.random_request(others)))
                for _ in range(rng.randrange(1, 4)):
                    raw[rng.randrange(len(raw))] = rng.randrange(256)
                return bytes(raw[:rng.randrange(len(raw) + 1)] if rng.random() < 0.3 else raw)
            case _:  # valid msgpack of the wrong shape
                return msgspec.msgpack.encode(self.pick((
                    ["reserve", rid, sid, [["kv", "notalist"]]],
                    ["commit", rid, sid, "rid", [[1, 2]]],
                    ["lease", rid, sid, [["kv", [1, 2]]]],
                    ["release", rid, sid, [1.5]],
                    ["exists", rid, sid, ["a"], [["kv", "all_pages", "w"]]],
                    ["hello", rid],
                    {"op": "ping", "req_id": rid},
                    ["nope", rid],
                    [],
                    [[[[[[[]]]]]]],
                )))


def well_behaved_round(daemon, n: int) -> None:
    """A normal client stores KV + Mamba pages and reads them back byte-exact."""
    src, dst = kv_pool(seed=n), kv_pool()
    msrc, mdst = mamba_pool(seed=n), mamba_pool()
    keys = [f"good-{n}-{i}" for i in range(4)]
    with daemon.client(shared_exists=n % 2 == 0) as c:
        c.register_mem_host_pool_v2(src, "kv")
        c.register_mem_host_pool_v2(msrc, "mamba")
        stored = c.batch_set_v2([PoolTransfer("kv", pages(0, 4), keys=keys),
                                 PoolTransfer("mamba", torch.tensor([3]), keys=keys[-1:])])
        assert stored == {"kv": [True] * 4, "mamba": [True]}
        hit = c.batch_exists_v2(keys, [PoolTransfer("mamba", keys=keys[:1],  # window 1
                                                    hit_policy=PoolHitPolicy.TRAILING_PAGES)])
        assert hit.kv_hit_pages == 4, hit
    with daemon.client() as c:
        c.register_mem_host_pool_v2(dst, "kv")
        c.register_mem_host_pool_v2(mdst, "mamba")
        got = c.batch_get_v2([PoolTransfer("kv", pages(4, 4), keys=keys),
                              PoolTransfer("mamba", torch.tensor([5]), keys=keys[-1:])])
        assert got == {"kv": [True] * 4, "mamba": [True]}
    assert torch.equal(dst.kv_buffer[:, 16:32], src.kv_buffer[:, 0:16])
    for b_src, b_dst in zip(msrc.buffers, mdst.buffers):
        assert torch.equal(b_dst[5], b_src[3])


SEEDS = [int(s) for s in os.environ.get("FUZZ_SEEDS", "1,2").split(",")]


@pytest.mark.parametrize("seed", SEEDS)
def test_fuzzed_requests_never_hurt_the_daemon_or_other_clients(make_daemon, seed):
    """Namespace model-b has pages of 256 KiB and a quota of 24 of them: it evicts, loads from
    L3, gets slot tags and set-ahead slots; model-a's pages are small (what model-b pins cannot
    leave model-a without room: that is what quotas are for)."""
    d = make_daemon(l2_size="12MiB", extra=[
        "--reservation-ttl-s", "2", "--lease-ttl-s", "2", "--set-ahead-bytes", "1MiB",
        "--get-wait-s", "0.5", "--namespace-quotas", '{"model-b": "6MiB"}'])
    rng = random.Random(seed)
    advs = [Adversary(d.endpoint, rng, ns) for ns in ("model-a", "model-a", "model-b")]
    try:
        for a in advs:
            a.hello()
            kv_bytes = BIG_PAGE_BYTES if a.namespace == "model-b" else KV_PAGE_BYTES
            for pool, nbytes in (("kv", kv_bytes), ("mamba", MAMBA_PAGE_BYTES)):
                a.ask(P.RegisterPool(a.next_id(), a.sessions[0], pool, nbytes))
        for rnd in range(6):
            for _ in range(300):
                a = rng.choice(advs)
                others = [s for b in advs if b is not a for s in b.sessions]
                msg = a.random_request(others)
                if rng.random() < 0.8:
                    a.send(msg)  # pipelined: answers read later, in any order
                else:
                    a.send(msg)
                    a.answers(wait_ms=20)
            for a in advs:  # its requests so far are handled (one socket: in order)
                a.ask(P.Ping(a.next_id()))
            well_behaved_round(d, rnd)
            assert d.proc.poll() is None, f"seed {seed} round {rnd}: daemon died"
        for a in advs:  # end every session the attacks opened
            while a.answers(wait_ms=200):
                pass
            for sid in a.sessions:
                a.send(P.Bye(0, sid))
        with d.client() as c:
            assert wait_until(lambda: c.stats()["reservations"] == 0, 5)
            assert wait_until(lambda: c.stats()["fenced_bytes"] == 0, 8)
            assert wait_until(lambda: c.stats()["leases"] == 0, 5)
            c.flush()
            s = c.stats()
            assert s["set_ahead_bytes"] == 0 and s["l2_used_bytes"] == 0, s
            assert s["l2_pages"] == 0 and s["sessions"] == 1, s
        assert "internal error" not in d.output(), d.output()[-4000:]
        assert "Traceback" not in d.output(), d.output()[-4000:]
    finally:
        for a in advs:
            a.close()


def test_sessions_own_their_reservations_leases_and_ids(daemon):
    """Every session-owned thing, named by another session (or none): a typed error or nothing,
    never an effect on its owner."""
    rng = random.Random(0)
    a, b, c = (Adversary(daemon.endpoint, rng, ns) for ns in ("model-a", "model-a", "model-b"))
    try:
        for adv in (a, b, c):
            adv.hello()
            adv.ask(P.RegisterPool(adv.next_id(), adv.sessions[0], "kv", KV_PAGE_BYTES))
            adv.ask(P.RegisterPool(adv.next_id(), adv.sessions[0], "mamba", MAMBA_PAGE_BYTES))
        sa, sb, sc = a.sessions[0], b.sessions[0], c.sessions[0]
        for sid in (0, 12345):  # no handshake: nothing works
            for msg in (P.Reserve(1, sid, [P.PoolKeys("kv", ["s0"])]), P.Lease(2, sid, []),
                        P.Commit(3, sid, 1, [[True]]), P.RegisterPool(4, sid, "kv", 1024)):
                assert b.ask(msg).code == "unknown_session"
        res = a.ask(P.Reserve(5, sa, [P.PoolKeys("kv", ["s0", "s1"]), P.PoolKeys("mamba", ["s1"])]))
        assert res.reservation_id and min(map(min, res.offsets)) >= 0
        ok = [[True, True], [True]]
        for thief, sid in ((b, sb), (c, sc)):  # another session's commit publishes nothing
            assert thief.ask(P.Commit(6, sid, res.reservation_id, ok)).stored == [[False] * 2,
                                                                                  [False]]
        assert b.ask(P.Exists(7, sb, ["s0", "s1"])).kv_hit_pages == 0
        assert b.ask(P.Lease(8, sb, [P.PoolKeys("kv", ["s0"])])).offsets == [[P.SLOT_MISS]]
        assert a.ask(P.Commit(9, sa, res.reservation_id, ok)).stored == ok
        assert a.ask(P.Commit(10, sa, res.reservation_id, ok)).stored == [[False] * 2, [False]]
        assert b.ask(P.Exists(11, sb, ["s0", "s1"])).kv_hit_pages == 2
        assert c.ask(P.Exists(12, sc, ["s0", "s1"])).kv_hit_pages == 0  # another namespace
        leased = a.ask(P.Lease(13, sa, [P.PoolKeys("kv", ["s0", "s1"])]))
        assert leased.lease_id
        b.send(P.Release(0, sb, [leased.lease_id]))  # not its lease: nothing happens
        c.send(P.Release(0, sc, [leased.lease_id]))
        assert a.ask(P.GetStats(14)).stats["leases"] == 1
        a.send(P.Release(0, sa, [leased.lease_id, leased.lease_id]))  # twice: once
        assert a.ask(P.GetStats(15)).stats["leases"] == 0
        c.ask(P.Hello(16, P.PROTOCOL_VERSION, "model-b", os.getpid(), replaces=sa))
        assert a.ask(P.Ping(17)) and a.ask(P.Exists(18, sa, ["s0"])).kv_hit_pages == 1
        sa2 = a.hello()  # a second handshake on one connection: a second session
        # it asks about its namespace's pools (vLLM's scheduler asks about its workers'), and
        # only those
        assert a.ask(P.Exists(19, sa2, ["s0"])).kv_hit_pages == 1
        assert a.ask(P.Exists(23, sa2, ["s0"], [P.PoolQuery("swa", "all_pages")])).code == \
            "unknown_pool"
        assert a.ask(P.Exists(20, sa, ["s0"])).kv_hit_pages == 1
        a.send(P.Bye(0, sa))
        assert a.ask(P.Exists(21, sa, ["s0"])).code == "unknown_session"  # ids are not reused
        stats = a.ask(P.GetStats(22)).stats
        assert (stats["reservations"], stats["leases"], stats["fenced_bytes"]) == (0, 0, 0)
    finally:
        for adv in (a, b, c):
            adv.close()
    assert "internal error" not in daemon.output()
