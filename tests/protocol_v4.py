"""Messages as clients and daemons of protocol version 4 had them before trailing fields were
appended: ``Reserve`` before its chain fields (``anchor_pool``, ``parent``, ``depth``),
``Flush`` before ``namespace`` and ``Welcome`` before ``flush_namespace``. What an older client
sends, and the decoders an older daemon reads requests with and an older client reads answers
with."""

import msgspec

from hicached import protocol as P


class _OldMsg(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag_field="op"):
    pass


class OldReserve(_OldMsg, tag="reserve"):
    req_id: int
    session: int
    transfers: list[P.PoolKeys]
    ahead: list[list[int]] = []
    want_ahead: list[int] = []
    release: list[int] = []


class OldFlush(_OldMsg, tag="flush"):
    req_id: int
    tier: str = "l2"


class OldWelcome(_OldMsg, tag="welcome"):
    req_id: int
    session: int
    arena_path: str
    arena_bytes: int
    daemon_pid: int
    reservation_ttl_s: float
    lease_ttl_s: float
    presence_path: str = ""
    presence_slots: int = 0
    presence_epoch: int = 0
    presence_seed: int = 0
    presence_session: int = -1


# an older daemon's request decoder: every request as today but Reserve and Flush
old_request_decoder = msgspec.msgpack.Decoder(
    OldReserve | P.Hello | P.RegisterPool | P.Exists | P.ExistsTally | P.Commit | P.Lease
    | P.Release | P.Bye | OldFlush | P.Attach | P.Detach | P.GetBackend | P.GetStats | P.Ping)
# an older client's answer decoder: every answer as today but Welcome
old_answer_decoder = msgspec.msgpack.Decoder(
    OldWelcome | P.Registered | P.Ok | P.ExistsResult | P.Reserved | P.Committed | P.Leased
    | P.Stats | P.BackendStatus | P.Error)
