"""``Reserve`` as clients and daemons of protocol version 4 had it before the chain fields
(``anchor_pool``, ``parent``, ``depth``) were appended: what an older client sends, and the
decoder an older daemon reads requests with."""

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


# an older daemon's request decoder: every request as today but Reserve
old_request_decoder = msgspec.msgpack.Decoder(
    OldReserve | P.Hello | P.RegisterPool | P.Exists | P.ExistsTally | P.Commit | P.Lease
    | P.Release | P.Bye | P.Flush | P.Attach | P.Detach | P.GetBackend | P.GetStats | P.Ping)
