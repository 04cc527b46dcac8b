"""Bad input never takes the daemon down: typed errors for bad calls, malformed frames, wrong
protocol versions, oversized requests; an unreachable daemon fails fast."""

import os
import signal
import time

import msgspec
import pytest
import torch
import zmq
from conftest import raw_socket, sigstop
from pools import kv_pool, mamba_pool, pages

from hicached import HostPool, PoolTransfer
from hicached import protocol as P
from hicached.errors import (
    DaemonUnavailable,
    LengthMismatch,
    PageSizeMismatch,
    ProtocolError,
    RequestTooLarge,
    UnknownPool,
)


def test_bad_input_gets_typed_errors(daemon):
    with daemon.client() as c:
        c.register_mem_host_pool_v2(kv_pool(), "kv")
        with pytest.raises(UnknownPool):
            c.batch_get_v2([PoolTransfer("swa", pages(0, 1), keys=["a"])])
        with pytest.raises(LengthMismatch):
            c.batch_set_v1(["a", "b"], pages(0, 1))
        with daemon.client() as other, pytest.raises(PageSizeMismatch):
            other.register_mem_host_pool_v2(
                HostPool.allocate_mha(8, 8, layers=2, heads=2, head_dim=8,
                                      dtype=torch.float32), "kv")
        from hicached import protocol as P
        with pytest.raises(UnknownPool):
            c._conn.call(lambda s, r: P.Exists(r, s, ["a"], [P.PoolQuery("mamba", "all_pages")]))
        c.register_mem_host_pool_v2(mamba_pool(), "mamba")
        from hicached.errors import ProtocolError
        with pytest.raises(ProtocolError, match="hit policy"):
            c._conn.call(lambda s, r: P.Exists(r, s, ["a"], [P.PoolQuery("mamba", "sometimes")]))
        assert c.batch_set_v1(["ok"], pages(0, 1)) == [True]  # still serving


def test_unusable_transfers_raise_invalid_transfer_and_store_nothing(daemon):
    from hicached import InvalidTransfer
    with daemon.client() as c:
        src = kv_pool(seed=8)
        c.register_mem_host_pool_v2(src, "kv")
        stats = c.stats()
        bad_indices = (torch.arange(1000 * 4, 1001 * 4),  # outside the pool
                       torch.arange(-4, 0),  # negative
                       torch.arange(2, 6),  # not a page start
                       torch.arange(0, 4).float())  # not integers
        for idx in bad_indices:
            for call in (c.batch_set_v1, c.batch_get_v1):
                with pytest.raises(InvalidTransfer):
                    call(["bad0"], idx)
        with pytest.raises(InvalidTransfer, match="named twice"):
            c.batch_set_v2([PoolTransfer("kv", pages(0, 1), keys=["d0"]),
                            PoolTransfer("kv", pages(1, 1), keys=["d1"])])
        with pytest.raises(InvalidTransfer, match="longer than"):
            c.batch_set_v1(["k" * (P.MAX_KEY_LEN + 1)], pages(0, 1))
        with pytest.raises(InvalidTransfer):
            c.batch_set_pages("kv", ["p0"], [torch.zeros(3)])  # not a page of this pool
        with pytest.raises(ProtocolError, match="Expected `str`"):  # the daemon's word
            c.batch_exists_v2([b"bytes-key"])
        with pytest.raises(InvalidTransfer, match="keys must be str"):  # cannot even be sent
            c.batch_exists_v2([object()])
        assert isinstance(InvalidTransfer("x"), ValueError)  # what callers caught before
        after = c.stats()
        assert c.batch_exists(["bad0", "d0", "d1", "p0"]) == 0
        assert after["reservations"] == 0 and after["leases"] == 0
        assert after["l2_pages"] == stats["l2_pages"]
        assert c.batch_set_v1(["ok0"], pages(0, 1)) == [True]  # the client carries on


def test_malformed_frames_and_wrong_version(daemon):

    from hicached import protocol as P
    with raw_socket(daemon.endpoint) as s:
        for junk in (b"", b"\xc1\xc1", b"not msgpack at all", P.encode(P.Ok(3))):
            s.send(junk)
            ans = P.answer_decoder.decode(s.recv())
            assert isinstance(ans, P.Error) and ans.code == "malformed"
        s.send_multipart([b"two", b"frames"])
        assert P.answer_decoder.decode(s.recv()).code == "malformed"
        # a request that does not decode is answered with its own req_id when it has one (no
        # waiting for a deadline); bytes that are not UTF-8 or nest too deep are no crash
        bad_utf8 = b"\x94\xa5lease\x09\xa6notint\xa1\xff"
        for junk, req_id in ((bad_utf8, 0), (b"\x91" * 5000 + b"\x01", 0),
                             (P.encode(P.Lease(11, 5, [P.PoolKeys("kv", [])]))[:-1], 0),
                             (msgspec.msgpack.encode(["lease", 12, "x"]), 12)):
            s.send(junk)
            ans = P.answer_decoder.decode(s.recv())
            assert (ans.code, ans.req_id) == ("malformed", req_id), junk
        s.send(P.encode(P.Hello(9, 999, "ns", os.getpid())))
        ans = P.answer_decoder.decode(s.recv())
        assert ans.code == "version_mismatch" and ans.req_id == 9
        s.send(P.encode(P.Exists(10, 12345, ["a"])))
        assert P.answer_decoder.decode(s.recv()).code == "unknown_session"
        s.send(P.encode(P.Hello(13, P.PROTOCOL_VERSION, "ns", os.getpid())))
        sid = P.answer_decoder.decode(s.recv()).session
        s.send(P.encode(P.RegisterPool(16, sid, "kv", 1024)))
        assert isinstance(P.answer_decoder.decode(s.recv()), P.Registered)
        s.send(P.encode(P.Exists(14, sid, [], packed=b"k0\0\xff\xfe")))  # not UTF-8
        assert P.answer_decoder.decode(s.recv()).code == "malformed"
        # counts a client reports are bounded: totals that no longer encode (past 2**64) would
        # have ended the daemon at the next Stats answer
        huge = (1 << 63) - 1
        for msg in (P.Release(0, sid, [], shared_gets=huge), P.Release(0, sid, [], shared_gets=-1),
                    P.ExistsTally(0, sid, huge, {}, {}), P.ExistsTally(0, sid, 1, {"kv": -5}, {})):
            s.send(P.encode(msg))
            assert P.answer_decoder.decode(s.recv()).code == "malformed"
        for _ in range(3):
            s.send(P.encode(P.Release(0, sid, [], shared_gets=1 << 40)))
        s.send(P.encode(P.GetStats(15)))
        ans = P.answer_decoder.decode(s.recv())
        assert isinstance(ans, P.Stats) and ans.stats["shared_gets"] == 3 << 40
    with daemon.client() as c:
        c.ping()  # others unaffected
    assert "internal error" not in daemon.output()


def test_oversized_requests_are_refused_and_the_daemon_carries_on(daemon):
    """The client refuses to send a request past the daemon's limit (a typed error, nothing
    sent); a peer that sends one anyway loses its connection, nobody else notices."""

    keys = [f"{i:08d}" * 1250 for i in range(7000)]  # 10 kB keys, 70 MB in all
    with daemon.client(shared_exists=False) as c:
        c.register_mem_host_pool_v2(kv_pool(seed=5), "kv")
        with pytest.raises(RequestTooLarge, match="split the call"):
            c.batch_exists(keys)
        assert c.batch_set_v1(["ok0"], pages(0, 1)) == [True]  # the same client carries on
        with raw_socket(daemon.endpoint, timeout_ms=1000) as s:
            s.send(P.encode(P.Exists(1, c.session, keys)))
            with pytest.raises(zmq.Again):  # dropped unread: no answer
                s.recv()
        assert c.batch_exists(["ok0"]) == 1
    assert "internal error" not in daemon.output()


def test_unreachable_daemon_fails_fast(tmp_path, daemon):
    t = time.monotonic()
    with pytest.raises(DaemonUnavailable, match="no daemon socket"):
        from hicached import Client
        Client(f"ipc://{tmp_path}/nobody.sock", "ns")
    assert time.monotonic() - t < 1.0
    c = daemon.client(timeout_s=0.5)
    sigstop(daemon.proc.pid)  # alive but not answering
    try:
        t = time.monotonic()
        with pytest.raises(DaemonUnavailable, match="within 0.5s"):
            c.ping()
        assert time.monotonic() - t < 2.0
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    c.ping()  # recovers once the daemon answers again
    c.close()


def test_exists_with_a_window_past_int64_is_malformed_not_lost(daemon):
    """A trailing window the daemon's int64 arithmetic cannot hold was an internal error, and
    unanswered when the request waited for L3 (keys L2 lacks): the client hung to its deadline."""
    with raw_socket(daemon.endpoint, timeout_ms=3000) as s:
        s.send(P.encode(P.Hello(1, P.PROTOCOL_VERSION, "model-a", os.getpid())))
        sid = P.answer_decoder.decode(s.recv()).session
        s.send(P.encode(P.RegisterPool(2, sid, "kv", 1024)))
        assert isinstance(P.answer_decoder.decode(s.recv()), P.Registered)
        for req_id, window in ((3, (1 << 64) - 1), (4, 1 << 63), (5, (1 << 40) + 1)):
            s.send(P.encode(P.Exists(req_id, sid, ["w0", "w1"],
                                     [P.PoolQuery("kv", "trailing_pages", window)])))
            ans = P.answer_decoder.decode(s.recv())
            assert (type(ans), ans.req_id, ans.code) == (P.Error, req_id, "malformed"), ans
        s.send(P.encode(P.Exists(6, sid, ["w0"], [P.PoolQuery("kv", "trailing_pages", 1 << 40)])))
        assert isinstance(P.answer_decoder.decode(s.recv()), P.ExistsResult)
    assert "internal error" not in daemon.output()


def test_a_malformed_answer_is_a_protocol_error(tmp_path):
    """Whatever answers on the socket, the client raises a typed error (not msgspec's)."""
    import threading

    from hicached import Client
    endpoint = f"ipc://{tmp_path}/fake.sock"
    ctx = zmq.Context()
    peer = ctx.socket(zmq.ROUTER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.bind(endpoint)
    answers = [b"\xc1", msgspec.msgpack.encode(["welcome", 1, "x"]), b"\x91" * 5000]

    def serve():
        for answer in answers:
            if not peer.poll(5000):
                return
            identity, _ = peer.recv_multipart()
            peer.send_multipart([identity, answer])
    t = threading.Thread(target=serve)
    t.start()
    try:
        for _ in answers:
            with pytest.raises(ProtocolError, match="malformed answer to Hello"):
                Client(endpoint, "ns", timeout_s=5)
    finally:
        t.join()
        peer.close()
        ctx.term()


def test_a_pool_name_cannot_take_l3_writes_outside_the_l3_root(daemon, tmp_path):
    """The file L3 named directories after pools: a client's pool "../../../escaped" made the
    daemon write page files beside its state directory (anywhere it could write). Such a name
    is refused at registration, and the session goes on."""
    with raw_socket(daemon.endpoint) as s:
        s.send(P.encode(P.Hello(1, P.PROTOCOL_VERSION, "model-a", os.getpid())))
        sid = P.answer_decoder.decode(s.recv()).session
        for pool in ("../../../escaped", str(tmp_path / "abs")):
            s.send(P.encode(P.RegisterPool(2, sid, pool, 1024)))
            answer = P.answer_decoder.decode(s.recv())
            assert isinstance(answer, P.Error) and "pool name" in answer.message, answer
        s.send(P.encode(P.RegisterPool(3, sid, "kv", 1024)))
        assert isinstance(P.answer_decoder.decode(s.recv()), P.Registered)
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "abs").exists()
