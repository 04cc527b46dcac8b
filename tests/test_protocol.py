"""Every Struct round-trips; malformed frames raise typed decode errors."""

import msgspec
import pytest

from hicached import protocol as P

REQUESTS = [
    P.Hello(1, P.PROTOCOL_VERSION, "ns", 123, "engine"),
    P.RegisterPool(2, 7, "kv", 4096),
    P.Exists(3, 7, ["a", "b"], [P.PoolQuery("mamba", "trailing_pages", 1)]),
    P.Exists(3, 7, ["a"]),
    P.Reserve(4, 7, [P.PoolKeys("kv", ["a"]), P.PoolKeys("mamba", ["a"])]),
    P.Commit(5, 7, 11, [[True], [False]]),
    P.Commit(5, 7, 11, abort=True),
    P.Lease(6, 7, [P.PoolKeys("kv", ["a", "b"])]),
    P.Release(0, 7, [1, 2]),
    P.Bye(0, 7),
    P.Flush(8, "all"),
    P.Flush(8, "l2", "sglang|model=a"),
    P.GetStats(9),
    P.Ping(10),
    P.WaitStored(11, 7, [P.PoolKeys("kv", ["a", "b"]), P.PoolKeys("mamba", ["b"])], 2.5),
]
ANSWERS = [
    P.Welcome(1, 7, "/dev/shm/x", 1 << 30, 99, 30.0, 30.0),
    P.Welcome(1, 7, "/dev/shm/x", 1 << 30, 99, 30.0, 30.0, flush_namespace=True),
    P.Ok(2),
    P.ExistsResult(3, 2, {"kv": 2, "mamba": 2}, [2]),
    P.Reserved(4, 11, [[0, P.SLOT_PRESENT], [P.SLOT_NO_SPACE, P.SLOT_INFLIGHT]]),
    P.Committed(5, [[True], [False]]),
    P.Leased(6, 12, [[4096, P.SLOT_MISS]]),
    P.Stats(9, {"l2_pages": 3, "l3": {"pages": 1}}),
    P.Error(7, "unknown_pool", "pool 'x'"),
]


@pytest.mark.parametrize("msg", REQUESTS, ids=lambda m: type(m).__name__)
def test_request_roundtrip(msg):
    assert P.request_decoder.decode(P.encode(msg)) == msg


@pytest.mark.parametrize("msg", ANSWERS, ids=lambda m: type(m).__name__)
def test_answer_roundtrip(msg):
    assert P.answer_decoder.decode(P.encode(msg)) == msg


def test_answers_are_not_requests():
    with pytest.raises(msgspec.ValidationError):
        P.request_decoder.decode(P.encode(P.Ok(1)))


@pytest.mark.parametrize("raw", [b"", b"\xc1", b"garbage", msgspec.msgpack.encode(["hello", 1])])
def test_malformed_frames_raise(raw):
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        P.request_decoder.decode(raw)


def test_wrong_field_type_raises():
    raw = msgspec.msgpack.encode(["register_pool", 1, 7, "kv", "not-an-int"])
    with pytest.raises(msgspec.ValidationError):
        P.request_decoder.decode(raw)


@pytest.mark.parametrize("timeout_s", [0, -1, 3601])
def test_a_wait_stored_deadline_out_of_bounds_is_refused(timeout_s):
    raw = msgspec.msgpack.encode(["wait_stored", 1, 7, [["kv", ["a"]]], timeout_s])
    with pytest.raises(msgspec.ValidationError):
        P.request_decoder.decode(raw)


def test_an_older_daemon_refuses_wait_stored_by_name():
    """A daemon older than ``WaitStored`` answers ``malformed`` with the tag in its message:
    ``Client.wait_stored`` says the daemon is too old."""
    from protocol_v4 import old_request_decoder

    with pytest.raises(msgspec.ValidationError, match="wait_stored"):
        old_request_decoder.decode(P.encode(P.WaitStored(1, 7, [P.PoolKeys("kv", ["a"])])))


def test_flush_namespace_is_a_trailing_field_older_peers_read_past():
    """An older client's Flush (no namespace) is a flush of the whole node; an older daemon
    reads past the namespace and would flush the whole node, which is why a client names one
    only to a daemon whose Welcome says ``flush_namespace`` (an older client reads past that)."""
    from protocol_v4 import OldFlush, OldWelcome, old_answer_decoder, old_request_decoder

    assert P.request_decoder.decode(P.encode(OldFlush(3, "all"))) == P.Flush(3, "all", "")
    old = old_request_decoder.decode(P.encode(P.Flush(3, "l3", "ns")))
    assert old == OldFlush(3, "l3")
    new = P.Welcome(1, 7, "/dev/shm/x", 1 << 30, 99, 30.0, 30.0, flush_namespace=True)
    assert old_answer_decoder.decode(P.encode(new)) == OldWelcome(
        1, 7, "/dev/shm/x", 1 << 30, 99, 30.0, 30.0)
    older = OldWelcome(1, 7, "/dev/shm/x", 1 << 30, 99, 30.0, 30.0, "/dev/shm/x.p", 64)
    assert P.answer_decoder.decode(P.encode(older)).flush_namespace is False


def test_packed_exists_keys_round_trip():
    keys = ["a", "b/ü", "", "c" * 300]
    m = P.request_decoder.decode(P.encode(P.Exists(1, 2, [], packed=P.pack_keys(keys))))
    assert m.key_list() == keys
    assert P.pack_keys(["x\0y", "z"]) == b""  # a NUL inside a key: send the list instead
    assert P.pack_keys([]) == b""
    assert P.Exists(1, 2, ["x\0y"]).key_list() == ["x\0y"]
