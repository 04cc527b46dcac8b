"""Page keys (SGLang's SHA-256 chain over uint32 token ids) and namespaces."""

import hashlib
import struct

import pytest

from hicached.keys import KeyChain, namespace, page_hash, page_keys


def test_page_keys_are_sglangs_sha256_chain():
    ids = list(range(10))
    keys = page_keys(ids, 4)
    assert len(keys) == 2  # the partial third page has no key
    first = hashlib.sha256(struct.pack("<4I", 0, 1, 2, 3)).hexdigest()
    second = hashlib.sha256(bytes.fromhex(first) + struct.pack("<4I", 4, 5, 6, 7)).hexdigest()
    assert keys == [first, second]
    assert page_hash([4, 5, 6, 7], first) == second
    chain = KeyChain(4)
    chain.extend(ids[:5])
    assert chain.extend(ids) == keys
    assert page_keys([1, 2, 3, 5], 4) != page_keys([1, 2, 3, 4], 4)
    with pytest.raises(ValueError, match="does not fit"):
        page_keys([-1, 0, 0, 0], 4)


def test_namespace_names_everything_that_changes_bytes():
    ns = namespace("qwen3_next-h64", "c7af", "float32", "mha", 16, salt="tenant-a")
    assert ns == "qwen3_next-h64|c7af|float32|mha|p16|tp0of1|tenant-a"
    assert ns != namespace("qwen3_next-h64", "c7af", "float32", "mha", 16, salt="tenant-b")
    with pytest.raises(ValueError, match="no '|'"):
        namespace("a|b", "w", "float32", "mha", 16)
