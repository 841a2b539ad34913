"""shared/prefix_hash: the chain names a prefix, the salt separates weights."""
from hypothesis import given, strategies as st

from shared.prefix_hash import block_hashes, matched_blocks, prefix_salt

SALT = prefix_salt("m")


@given(st.lists(st.integers(0, 2**31 - 1), max_size=80), st.integers(1, 16))
def test_hashes_name_prefixes(tokens, bs):
    hs = block_hashes(tokens, bs, SALT)
    assert len(hs) == len(tokens) // bs
    # A longer prompt with the same prefix shares exactly the prefix's blocks.
    assert block_hashes(tokens + [7] * bs, bs, SALT)[:len(hs)] == hs


def test_change_in_an_early_block_changes_every_later_hash():
    a = list(range(64))
    b = list(a)
    b[3] = 999
    ha, hb = block_hashes(a, 16, SALT), block_hashes(b, 16, SALT)
    assert all(x != y for x, y in zip(ha, hb))


def test_salt_separates_models_and_adapters():
    t = list(range(32))
    assert block_hashes(t, 16, prefix_salt("m")) != block_hashes(t, 16, prefix_salt("m", "lora-a"))
    assert block_hashes(t, 16, prefix_salt("m")) != block_hashes(t, 16, prefix_salt("n"))


def test_match_stops_at_first_miss():
    hs = block_hashes(list(range(64)), 16, SALT)
    assert matched_blocks(hs, set(hs)) == 4
    assert matched_blocks(hs, {hs[0], hs[1], hs[3]}) == 2
    assert matched_blocks(hs, set()) == 0
