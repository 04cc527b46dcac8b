"""KeyMemory: (table, key) facts looked up per table, bounded, the oldest forgotten first."""

from hicached.daemon.l3.keymemory import KeyMemory

A, B = ("ns", "kv"), ("ns", "mamba")


def test_remembers_per_table_and_forgets_the_oldest_past_its_limit():
    m = KeyMemory(limit=3)
    m[(A, "k1")] = 1.0
    m[(B, "k1")] = 2.0  # same key, another table: another fact
    m[(A, "k2")] = 3.0
    assert (A, "k1") in m and (B, "k1") in m and (B, "k2") not in m
    assert m.of(A) == {"k1": 1.0, "k2": 3.0} and m.of(("other", "kv")) == {}
    m[(A, "k1")] = 4.0  # refreshed: now the newest
    m[(A, "k3")] = 5.0  # past the limit: (B, k1), the oldest, goes
    assert len(m) == 3 and (B, "k1") not in m and m.of(B) == {}
    assert m.of(A) == {"k1": 4.0, "k2": 3.0, "k3": 5.0}


def test_pop_and_clear():
    m = KeyMemory(limit=10)
    m[(A, "k")] = 7
    assert m.pop((A, "k")) == 7 and m.pop((A, "k"), "none") == "none"
    assert (A, "k") not in m and len(m) == 0 and m.of(A) == {}
    m[(A, "k")] = 1
    m[(B, "k")] = 2
    m.clear()
    assert len(m) == 0 and m.of(A) == {} and (B, "k") not in m
    m[(A, "x")] = 3  # usable again after clear
    assert m.of(A) == {"x": 3}
