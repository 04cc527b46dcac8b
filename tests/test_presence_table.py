"""The shared presence table (presence.py): fingerprints, the table and its readers' view."""

import os
import random
import time

import numpy as np
import pytest
import xxhash

from hicached.daemon.config import load_config
from hicached.presence import (
    F_CLOSED,
    H_FLAGS,
    H_MAGIC,
    KEY_BYTES,
    LOOKUP_SCALAR,
    LOOKUP_WINDOW,
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


def test_lookup_probes_alike_one_by_one_in_windows_and_in_their_tail():
    """Batches of 1 to 400 keys on tables at their fill limit (long probe runs): the scalar
    path (up to ``LOOKUP_SCALAR`` keys), the windows of ``LOOKUP_WINDOW`` slots and the keys
    probed on past their window all read the model exactly; also on a table of fewer slots
    than a window (it wraps)."""
    rng = random.Random(4)
    for slots in (1024, 4):
        path = f"/dev/shm/hicached-test-presence-{os.getpid()}-{time.monotonic_ns()}"
        t = PresenceTable(path, slots, epoch=5)
        try:
            keys = hexkeys(1200)
            stored = rng.sample(keys, int(slots * MAX_LOAD))
            model = {k: rng.randrange(1, 1 << 62) for k in stored}
            t.set_many(fingerprints(SEED, stored), np.array([model[k] for k in stored], np.int64))
            view = PresenceView(path, slots, 5, SEED)
            past = 0  # keys whose window held neither their fp nor an empty slot
            for n in (1, 2, 17, LOOKUP_SCALAR, LOOKUP_SCALAR + 1, 150, 400):
                for _ in range(5):
                    batch = rng.sample(keys, n) + stored[:2]
                    assert view.lookup(batch).tolist() == [model.get(k, 0) for k in batch], n
            for k in stored:  # a stored key's run: from its home to its slot, all occupied
                home = fingerprint(SEED, k) & (slots - 1)
                at = int(np.nonzero(view.table[:, 0] == fingerprint(SEED, k))[0][0])
                past += (at - home) % slots >= LOOKUP_WINDOW
            assert slots < LOOKUP_WINDOW or past > 0  # the tail path ran
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
