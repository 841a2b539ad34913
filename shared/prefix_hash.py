"""Block hashes for prefix caching: the one definition the engine and the dispatcher share.

A full KV block of `block_size` tokens is named by a hash chained over the previous
block's hash, the block's token ids and a salt naming what else changes the KV (the base
model and the LoRA adapter). Equal hashes at position i mean the same tokens 0..(i+1)*bs
under the same weights, so the engine can share the block and the dispatcher can count how
many of a request's leading blocks a worker holds — the scheme of vLLM's automatic prefix
caching. Only full blocks are named: a partial last block is never shared.

blake2b with an 8-byte digest: stable across processes and Python versions (the builtin
`hash` is salted per process), and 64 bits keeps collisions out of reach for any cache a
worker can hold. Pure: no I/O, no torch.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# The chain's first "previous hash": any fixed value, kept apart from real hashes.
ROOT_HASH = 0


def prefix_salt(model: str, adapter: str | None = None) -> bytes:
    """What besides the tokens decides a block's KV: the base model and the adapter."""
    return f"{model}\x00{adapter or ''}".encode()


def block_hash(parent: int, tokens: Sequence[int], salt: bytes) -> int:
    """The hash of one full block whose predecessor block hashed to `parent`."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<Q", parent))
    h.update(salt)
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return int.from_bytes(h.digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, salt: bytes,
                 limit: int | None = None) -> list[int]:
    """Hashes of the full blocks of `token_ids` in order (at most `limit` of them)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n = len(token_ids) // block_size
    if limit is not None:
        n = min(n, limit)
    out: list[int] = []
    parent = ROOT_HASH
    for i in range(n):
        parent = block_hash(parent, token_ids[i * block_size:(i + 1) * block_size], salt)
        out.append(parent)
    return out


def matched_blocks(request_hashes: Sequence[int], held: set[int] | frozenset[int]) -> int:
    """How many leading blocks of a request a holder of `held` hashes can reuse.

    The chain makes a hit at block i imply the whole prefix up to i, so the match stops at
    the first miss."""
    n = 0
    for h in request_hashes:
        if h not in held:
            break
        n += 1
    return n
