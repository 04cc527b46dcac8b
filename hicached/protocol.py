"""Every message between client and daemon: msgspec Structs, msgpack-encoded, one frame each.

Transport: the client's DEALER sends ``[payload]``; the daemon's ROUTER sees ``[identity, payload]``
and answers ``[identity, payload]``. Each request carries ``req_id`` (echoed in the answer, so a
client can drop late answers of a request it gave up on) and, after the handshake, ``session``.

Requests (client -> daemon)             answer
  Hello        handshake                 Welcome
  RegisterPool pool geometry             Registered (the pool's bit in the presence table)
  Exists       hit query                 ExistsResult
                 (or answered by the client from the shared presence table, ``presence.py``)
  ExistsTally  those answers, counted    (none: fire and forget; for the daemon's metrics)
  Reserve      set, step 1               Reserved
  Commit       set, step 2 (or abort)    Committed (or none, with reply=False)
  Lease        get                       Leased
  WaitStored   named pages in L3?        Ok, once they are stored there (or Error: not_stored,
                                         store_timeout, no_l3)
  Release      end of get leases         (none: fire and forget)
                 (usually piggybacked instead: ``release`` of the next Exists/Reserve/Lease)
                 and pages read without any lease, counted (``client/leaseless.py``)
  Bye          end of session            (none: fire and forget)
  Flush        empty L2 (and/or L3)      Ok
                 (of the node, or of one namespace)
  GetStats     counters (or the status)  Stats
  Ping         liveness                  Ok
  Attach       attach an L3 backend      BackendStatus
  Detach       detach it                 BackendStatus
  GetBackend   the L3 tier's status      BackendStatus
Any request may be answered with ``Error(code, message)`` (codes: ``errors.py``).

Slot answers (``Reserved.offsets`` / ``Leased.offsets``) are byte offsets into the arena, or one of
the negative sentinels below.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

# 2: shared presence table (Welcome.presence_*, Registered); 3: slot tags in it, Release.touched;
# 4: Hello.start_ticks / pid_ns (liveness.py), Hello.replaces
PROTOCOL_VERSION = 4

# The largest request a daemon reads (libzmq drops the connection of a peer sending more, so one
# client cannot make the daemon buffer or decode gigabytes); ``Client`` refuses to send one with
# ``RequestTooLarge``. About 900k keys of 64 hex characters in one exists.
MAX_REQUEST_BYTES = 64 << 20
# The longest key (characters) a page may be stored under (``Reserve``; SGLang's are 64): keys
# name files and store objects in L3, whose headers and names have bounds of their own.
MAX_KEY_LEN = 1024

# A count a client reports (tallies, unleased gets): never negative nor absurd; the daemon's
# totals of them saturate at COUNT_MAX (an unbounded int would break the Stats answer's encoding).
Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
COUNT_MAX = (1 << 63) - 1
# A trailing window (pages) an Exists may name: longer than any prefix (so no hit differs), and
# small enough for the int64 arithmetic of ``hits.trailing_mask`` (a window past 2**63 ended
# every answer to it as an internal error, and a parked one was never answered at all).
Window = Annotated[int, msgspec.Meta(le=1 << 40)]
# Pages before a key on its chain (``Reserve.depth``): -1 when not known, never absurd.
Depth = Annotated[int, msgspec.Meta(ge=-1, le=1 << 40)]

# Negative "offsets": what a key got instead of a slot.
SLOT_PRESENT = -1  # Reserve: already committed (nothing to copy; counts as stored)
SLOT_NO_SPACE = -2  # Reserve: arena full and nothing evictable
SLOT_INFLIGHT = -3  # Reserve: another client is writing this key right now
SLOT_MISS = -4  # Lease: not in L2 nor L3
SLOT_LOADING = -5  # Lease(stream): being loaded from L3; ask again (with load=False) for it


class _Msg(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag_field="op"):
    pass


class PoolKeys(msgspec.Struct, array_like=True, gc=False):
    """One pool's keys in a Reserve or Lease."""

    pool: str
    keys: list[str]


class PoolQuery(msgspec.Struct, array_like=True, gc=False):
    """One extra pool of an Exists: its hit policy and trailing window (pages)."""

    pool: str
    policy: str
    window: Window = 1


# ---------------------------------------------------------------- requests


class Hello(_Msg, tag="hello"):
    """Handshake. ``token``: the daemon's ``client_token`` when it has one (``auth.py``).
    ``pid``, ``start_ticks`` (its start time, ``/proc/self/stat``) and ``pid_ns`` (the inode of
    its pid namespace) say which process the client is, as the client sees it; the daemon
    prefers the kernel's word where the socket gives it (``liveness.py``). ``replaces``: the
    session this client held before (it handshakes again on a fresh socket): the daemon ends
    it, as a ``Bye`` would."""

    req_id: int
    version: int
    namespace: str
    pid: int
    client_name: str = ""
    token: str = ""
    start_ticks: int = 0
    pid_ns: int = 0
    replaces: int = 0


class RegisterPool(_Msg, tag="register_pool"):
    """A pool's geometry. ``event_hash`` / ``tokens_per_page``: its pages are the engine's
    blocks for KV events (``daemon/kv_events.py``): how a key encodes the engine's block hash
    ("": no events; ``kv_events.EVENT_HASHES``) and the tokens of a page. Trailing fields, as
    ``Reserve``'s chain fields: an older daemon ignores them, an older client sends none."""

    req_id: int
    session: int
    pool: str
    page_bytes: int
    event_hash: str = ""
    tokens_per_page: Annotated[int, msgspec.Meta(ge=0, le=1 << 30)] = 0


class Exists(_Msg, tag="exists"):
    """``packed``: the keys NUL-joined in one UTF-8 blob (``pack_keys``), used instead of ``keys``
    when non-empty. Still accepted, but ``Client`` sends the plain list: msgspec builds the key
    strings straight from it, which costs less on both ends than joining and splitting a blob."""

    req_id: int
    session: int
    keys: list[str]
    pools: list[PoolQuery] = []
    anchor: str = "kv"
    packed: bytes = b""
    release: list[int] = []  # piggybacked Release: leases this client is done with

    def key_list(self) -> list[str]:
        if not self.packed:
            return self.keys
        try:
            return self.packed.decode().split("\0")
        except UnicodeDecodeError as e:
            from hicached.errors import ProtocolError
            raise ProtocolError(f"malformed request: packed keys are not UTF-8 ({e})") from None


def pack_keys(keys: list[str]) -> bytes:
    """One blob for ``Exists.packed``, or b"" when a key holds NUL (then send the list)."""
    blob = "\0".join(keys)
    return b"" if not keys or blob.count("\0") != len(keys) - 1 else blob.encode()


class Reserve(_Msg, tag="reserve"):
    """Reserve slots for the keys of each pool transfer.

    Set-ahead (``leases.AheadSlots``): ``ahead[p][i]`` is the set-ahead slot (one the daemon
    granted in an earlier ``Reserved.ahead``) into which the client has already copied key i's
    page, -1 where none; ``want_ahead[p]`` is how many set-ahead slots of pool p the client wants
    to hold after this request (empty: no change; slots not named are kept unless fewer wanted).

    The call's chain (``PageIndex.link``): the keys of the ``anchor_pool`` transfer ("": the
    first transfer's) are consecutive pages of one sequence, key i+1's parent being key i;
    ``parent`` is the key of the page before the first one ("": a root, or not known) and
    ``depth`` the number of pages before it (-1: not known). Trailing fields, so no version
    bump: an older daemon ignores them, an older client sends none (a root of unknown depth).
    ``trailing`` names the call's pools with TRAILING_PAGES hits (Mamba states, sliding window):
    the eviction policy keeps a state only while its KV prefix is kept (``hybrid.py``).
    """

    req_id: int
    session: int
    transfers: list[PoolKeys]
    ahead: list[list[int]] = []
    want_ahead: list[int] = []
    release: list[int] = []  # piggybacked Release
    anchor_pool: str = ""
    parent: str = ""
    depth: Depth = -1
    trailing: list[str] = []  # the call's pools whose hits are TRAILING_PAGES (states)


class Commit(_Msg, tag="commit"):
    """Publish a reservation. ``ok[i][j]`` False (copy failed) aborts that page; empty ``ok``
    with ``abort=True`` aborts the whole reservation. ``reply=False``: no ``Committed`` answer
    (saves a round trip; the client's later requests on the same socket are still ordered after
    it, so it reads its own writes)."""

    req_id: int
    session: int
    reservation_id: int
    ok: list[list[bool]] = []
    abort: bool = False
    reply: bool = True
    seq: int = 0  # the client's count of commits sent: acknowledged in the presence table


class Lease(_Msg, tag="lease"):
    """Pin pages for a get. ``stream``: answer as soon as some pages are in L2, marking pages
    still loading from L3 ``SLOT_LOADING`` (the client copies what is there while the rest
    loads, then asks again). ``load=False``: start no new L3 loads (a stream's follow-up)."""

    req_id: int
    session: int
    transfers: list[PoolKeys]
    stream: bool = False
    load: bool = True
    release: list[int] = []  # piggybacked Release (released before this lease is taken)


# The longest a WaitStored may wait (seconds): the daemon answers at its deadline, never later.
WaitSeconds = Annotated[float, msgspec.Meta(gt=0, le=3600)]


class WaitStored(_Msg, tag="wait_stored"):
    """Answer ``Ok`` once every named committed page is stored in L3, whatever the write
    policy: pages L2 holds that L3 lacks are written now (under ``write_back`` and the
    selective policy too), writes in flight are waited for, pages L2 lacks are looked up in the
    store. The answer is ``Error`` when no L3 is attached (``no_l3``, at once; also when it is
    detached while the request waits), when a page cannot be stored (``not_stored``: its write
    failed, or it is in neither L2 nor L3) or at ``timeout_s`` (``store_timeout``). The request
    is parked while it waits: the control loop goes on. Sent on the socket that carried the
    pages' commit, it is read after it. A daemon older than this message answers
    ``malformed``."""

    req_id: int
    session: int
    transfers: list[PoolKeys]
    timeout_s: WaitSeconds = 5.0


class ExistsTally(_Msg, tag="exists_tally"):
    """Exists calls a client answered itself from the presence table since its last tally:
    ``keys`` asked per anchor pool, ``hits`` restorable pages per pool (as ``ExistsResult``)."""

    req_id: int
    session: int
    calls: Count
    keys: dict[str, Count]
    hits: dict[str, Count]


MAX_TOUCHED = 32768  # (offset, tag) pairs one Release reports at most (the daemon reads no more)


class Release(_Msg, tag="release"):
    """End get leases. A client sends it alone only when no request of its own carried the ids
    (``release`` of Exists / Reserve / Lease) within its ``release_delay_s``.

    It also reports the pages the client read without a lease (``client/leaseless.py``): ``touched``
    holds (offset, tag) pairs, flat; each page still in its slot counts as a hit, as a leased
    one would. ``shared_gets``: the get calls that needed no request at all."""

    req_id: int
    session: int
    lease_ids: list[int]
    touched: list[int] = []
    shared_gets: Count = 0


class Bye(_Msg, tag="bye"):
    req_id: int
    session: int


class Flush(_Msg, tag="flush"):
    """Drop unpinned pages: ``tier`` is ``l2``, ``l3`` or ``all``. ``namespace`` (a name, as in
    ``Hello``): only that namespace's pages, in L2 and in an L3 that can find them by
    namespace (else the answer is ``Error``, ``backend``, and nothing is dropped); "": every
    page of the node. A trailing field: an older client sends none (the whole node, as
    before), an older daemon reads past it and flushes the whole node, so a client names a
    namespace only to a daemon whose ``Welcome.flush_namespace`` says it reads it."""

    req_id: int
    tier: str = "l2"
    namespace: str = ""


class Attach(_Msg, tag="attach"):
    """Attach an L3 backend at runtime (``options`` are the backend's keyword options). Attaching
    the backend that is attached only updates the policies given."""

    req_id: int
    backend: str
    options: dict[str, Any] = {}
    write_policy: str = ""  # "" keeps the current one
    prefetch: bool | None = None  # None keeps the current one


class Detach(_Msg, tag="detach"):
    """Detach the L3 backend (idempotent); L2 keeps its pages."""

    req_id: int


class GetBackend(_Msg, tag="get_backend"):
    req_id: int


class GetStats(_Msg, tag="get_stats"):
    """``view``: "" the control loop's counters; "status" what ``hicached status`` shows (the
    admin API's ``/health``, ``/ready`` and ``/stats`` bodies, in one answer)."""

    req_id: int
    view: str = ""


class Ping(_Msg, tag="ping"):
    req_id: int


Request = (Hello | RegisterPool | Exists | ExistsTally | Reserve | Commit | Lease | Release | Bye
           | Flush | Attach | Detach | GetBackend | GetStats | Ping | WaitStored)

# ---------------------------------------------------------------- answers


class Welcome(_Msg, tag="welcome"):
    """Handshake answer. The TTLs let a client stop using slots it may no longer own."""

    req_id: int
    session: int
    arena_path: str
    arena_bytes: int
    daemon_pid: int
    reservation_ttl_s: float
    lease_ttl_s: float
    # the shared presence table (presence.py); "" when the daemon publishes none
    presence_path: str = ""
    presence_slots: int = 0
    presence_epoch: int = 0
    presence_seed: int = 0  # this session's namespace's fingerprint seed
    presence_session: int = -1  # this session's commit word in the table (-1: none)
    # the daemon reads ``Flush.namespace`` (an older one sends no such field: False)
    flush_namespace: bool = False


class Registered(_Msg, tag="registered"):
    """RegisterPool's answer: the pool's bit in its namespace's presence masks."""

    req_id: int
    bit: int


class Ok(_Msg, tag="ok"):
    req_id: int


class ExistsResult(_Msg, tag="exists_result"):
    req_id: int
    kv_hit_pages: int
    pool_hits: dict[str, int]
    restorable: list[int]


class Reserved(_Msg, tag="reserved"):
    """``tags``: per reserved slot its generation (``Leased.tags``), 0 where no slot.
    ``ahead[p]``: the set-ahead slots of pool p the session holds now (only when the request
    named ``want_ahead`` or ``ahead``). ``bound[p][i]``: key i got the set-ahead slot the request
    named for it, so its page is already in place (empty: none did)."""

    req_id: int
    reservation_id: int
    offsets: list[list[int]]
    tags: list[list[int]] = []
    ahead: list[list[int]] = []
    bound: list[list[bool]] = []


class Committed(_Msg, tag="committed"):
    req_id: int
    stored: list[list[bool]]


class Leased(_Msg, tag="leased"):
    """``tags``: per leased page the generation of its slot (0 where no page): a slot gets a
    new generation, unique for the daemon's life, every time it is given to a page. A client
    that saw (offset, tag) for a key before may copy from there before this answer arrives,
    and keeps the copy only if the answer names the same (offset, tag): the slot then held that
    page all along."""

    req_id: int
    lease_id: int
    offsets: list[list[int]]
    tags: list[list[int]] = []


class Stats(_Msg, tag="stats"):
    req_id: int
    stats: dict[str, Any]


class BackendStatus(_Msg, tag="backend_status"):
    """The L3 tier: backend name ("none" when detached), policies and backend counters."""

    req_id: int
    status: dict[str, Any]


class Error(_Msg, tag="error"):
    req_id: int
    code: str
    message: str


Answer = (Welcome | Registered | Ok | ExistsResult | Reserved | Committed | Leased | Stats | BackendStatus
          | Error)

# Built once: encoders are stateless, decoders typed to the direction they read.
encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
answer_decoder = msgspec.msgpack.Decoder(Answer)


def salvage_req_id(payload: bytes) -> int:
    """The ``req_id`` of a request that does not decode as one (so that its ``Error`` reaches the
    caller waiting for it, instead of a timeout), or 0."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError, ValueError):
        return 0
    if isinstance(raw, list) and len(raw) > 1 and type(raw[1]) is int and 0 < raw[1] < 1 << 63:
        return raw[1]
    return 0


def encode(msg: msgspec.Struct) -> bytes:
    """msgpack bytes of one message."""
    return encoder.encode(msg)
