"""Gets with no lease: pages this client has seen are copied straight from their slots, checked
against the slot tags the daemon publishes beside its presence table (``presence.py``).

A get leases its pages (a round trip) so that no slot is reused while the client copies out of it.
But a client that already knows where a page is (its (offset, tag) from an earlier set or get
answer, ``overlap.PageRecall``) can read it the way a seqlock reader does:

    1. tag at offset == tag     the page is committed there (tags are published at commit)
    2. copy it into the host pool
    3. tag at offset == tag     it was still there when the copy ended, so never freed meanwhile
       and the table is kept   (not closed, same epoch, fresh heartbeat: ``PresenceView.alive``)

The daemon zeroes a page's tag *before* it frees the slot, and a slot is written only once it has
been freed and handed out again (to a set's reservation or an L3 load), so a copy that read any
byte of a later page finds the tag changed at step 3. Tags are never reused (a counter from a
random start), so there is no ABA. This relies on the daemon's stores being seen in order and
causally, as on x86 (``presence.ORDERED_STORES``; elsewhere no table is used at all). A page that
fails step 1 is not copied; one that fails step 3 is copied again under a lease, as is every page
the client never saw. So a get of pages used before costs one copy and no message.

One instant for the whole get: a page whose tag is there before and after its copy was in its
slot all along in between (a tag once gone never comes back). The pages of one pool are checked
together, so they were all in L2 at one instant; those of another pool, or leased after them
(the daemon's answer, at a later instant), may not have been: a key evicted in between (all its
pools at once) came back as a KV hit with its INDEXER page missing. So once the last copy or
lease is done the tags of the pages read here are read once more (``still_there``): a page whose
tag is gone is a miss, and every hit of the get was in L2 at the instant of that last reading.

The daemon still learns of every such hit (LRU recency, hit counts, selective write-through,
metrics): the (offset, tag) pairs go out later in one ``Release`` (``piggyback.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from hicached.client.overlap import PageRecall
from hicached.kernels.pageio import PageIO
from hicached.presence import PresenceView

log = logging.getLogger(__name__)


def read_known(recall: PageRecall, view: PresenceView,
               todo: Sequence[tuple[str, PageIO, list[int]]], keys_of: dict[str, list[str]],
               starts_of: dict[str, list[int]], arena: Any
               ) -> tuple[dict[str, dict[int, tuple[int, int]]], list[int]]:
    """Copy the pages of ``todo`` (pool, io, positions into the call's keys) that this client
    knows, checked by their slot tags. Returns per pool the positions read, each with its tag
    word and tag (for ``still_there``), and the flat (offset, tag) pairs of those pages (for
    the daemon's accounting). Never raises: a pool whose copy fails reads nothing here.

    Plain Python over a memoryview of the tags, no numpy: the check after the copy runs with
    the CPU caches full of page bytes, where every numpy call costs several microseconds."""
    if not view.grain or not view.alive():
        return {}, []
    words, first, grain, covered = view.tag_words()
    read: dict[str, dict[int, tuple[int, int]]] = {}
    pairs: list[int] = []
    for name, io, idx in todo:
        if not recall.uses(io) or io.page_bytes < grain:
            continue  # no tag is published for pages smaller than a grain
        # (position, tag word, offset, tag) of the known pages whose tag is there now
        known = [(j, w, off, tag) for j, off, tag in recall.known(name, [keys_of[name][i]
                                                                          for i in idx])
                 if 0 <= off < covered and words[w := first + off // grain] == tag]
        if not known:
            continue
        starts = starts_of[name]
        try:
            io.from_arena([starts[idx[j]] for j, _, _, _ in known], arena.tensor,
                          [off for _, _, off, _ in known])
        except (ValueError, RuntimeError, TypeError, IndexError) as e:
            log.debug("unleased copy of pool %r failed: %s", name, e)
            continue
        done = {}
        for j, w, off, tag in known:
            if words[w] == tag:  # still there: the copy read this page's bytes
                done[j] = (w, tag)
                pairs += (off, tag)
        if done:
            read[name] = done
    if not read or not view.alive():  # the daemon stopped keeping the tags: lease them all
        return {}, []
    return read, pairs


def still_there(view: PresenceView, read: dict[str, dict[int, tuple[int, int]]]
                ) -> dict[str, list[int]]:
    """Per pool, the positions of ``read`` (``read_known``'s) whose page left its slot since
    (its tag is gone; all of them when the daemon stopped keeping the tags): misses now."""
    if not view.alive():
        return {name: list(got) for name, got in read.items()}
    words = view.tag_words()[0]
    gone = {}
    for name, got in read.items():
        lost = [j for j, (w, tag) in got.items() if words[w] != tag]
        if lost:
            gone[name] = lost
    return gone
