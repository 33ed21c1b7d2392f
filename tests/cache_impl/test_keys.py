"""Block keys: conformance vectors, chaining, and the fingerprint scoping every key."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import xxhash

from cache_impl.cache.keys import Fingerprint, KVLayout, block_keys

VECTORS = json.loads((Path(__file__).parents[1] / "data" / "key_vectors.json").read_text())["vectors"]


def _fingerprint(spec: dict) -> Fingerprint:
    return Fingerprint(
        spec["weights_digest"], spec["tokenizer_id"], KVLayout(**spec["layout"]),
        spec["format_version"], spec["tenant_salt"],
    )


@pytest.mark.parametrize(
    "vector", VECTORS, ids=lambda v: f"bs{v['fingerprint']['layout']['block_size']}-n{len(v['tokens'])}"
)
def test_keys_match_published_conformance_vectors(vector):
    fp = _fingerprint(vector["fingerprint"])
    assert fp.hex == vector["fingerprint_digest"]
    keys = block_keys(vector["tokens"], fp.digest, fp.layout.block_size)
    assert [k.hex() for k in keys] == vector["keys"]


def test_keys_follow_the_documented_formula_written_out_independently():
    fp = _fingerprint(VECTORS[0]["fingerprint"])
    tokens = list(range(100, 113))
    parent, expected = bytes(16), []
    for start in range(0, 12, 4):
        data = b"".join(t.to_bytes(4, "little") for t in tokens[start : start + 4])
        parent = xxhash.xxh3_128_digest(fp.digest + parent + data)
        expected.append(parent)
    assert block_keys(tokens, fp.digest, 4) == expected


def test_partial_last_block_has_no_key_and_keys_are_16_bytes(fingerprint):
    keys = block_keys(list(range(11)), fingerprint.digest, 4)
    assert len(keys) == 2 and all(len(k) == 16 for k in keys)


def test_key_depends_on_the_whole_prefix_not_only_its_own_tokens(fingerprint):
    a = block_keys([1, 2, 3, 4, 9, 9, 9, 9], fingerprint.digest, 4)
    b = block_keys([5, 6, 7, 8, 9, 9, 9, 9], fingerprint.digest, 4)
    assert a[1] != b[1]
    assert block_keys([1, 2, 3, 4, 9, 9, 9, 9], fingerprint.digest, 4) == a


@pytest.mark.parametrize(
    "change",
    [
        {"weights_digest": "seed-1"},
        {"tokenizer_id": "other-tokenizer"},
        {"format_version": 2},
        {"tenant_salt": "tenant-b"},
        {"layout": KVLayout(3, 2, 8, "float32", 4)},
        {"layout": KVLayout(2, 1, 8, "float32", 4)},
        {"layout": KVLayout(2, 2, 16, "float32", 4)},
        {"layout": KVLayout(2, 2, 8, "bfloat16", 4)},
        {"layout": KVLayout(2, 2, 8, "float32", 8)},
    ],
    ids=lambda c: next(iter(c)) if "layout" not in c else f"layout-{c['layout']}",
)
def test_any_fingerprint_field_changes_every_key(fingerprint, change):
    other = replace(fingerprint, **change)
    tokens = list(range(16))
    assert other.digest != fingerprint.digest
    old = set(block_keys(tokens, fingerprint.digest, 4))
    assert not old & set(block_keys(tokens, other.digest, other.layout.block_size))


def test_layout_rejects_bad_values_naming_the_field():
    with pytest.raises(ValueError, match=r"layout.head_dim: expected an integer >= 1, found 0"):
        KVLayout(2, 2, 0)
    with pytest.raises(ValueError, match=r"layout.dtype: expected one of .*found 'int7'"):
        KVLayout(2, 2, 8, "int7")


def test_a_token_array_a_list_and_a_uint32_ndarray_give_the_same_keys():
    import numpy as np

    from cache_impl.cache.keys import _token_bytes, block_keys, token_array

    tokens = [(i * 7919) % 70000 for i in range(1000)]
    digest = bytes(range(16))
    ids = token_array(tokens)
    assert block_keys(ids, digest, 16) == block_keys(tokens, digest, 16) == \
        block_keys(np.asarray(tokens, dtype=np.uint32), digest, 16)
    assert len(block_keys(ids, digest, 16)) == 1000 // 16
    view = _token_bytes(ids)
    assert view.obj is ids                                  # read in place, not converted again
    with pytest.raises(OverflowError):
        token_array([-1])
