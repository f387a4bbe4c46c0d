"""The prefix-cache block hash: one definition for the block pool and the router.

A block's hash chains its parent's hash, its token ids and anything else that changes the KV it
holds (the model identity), so equal hashes mean equal KV for equal prefixes across processes.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int], extra: str = "") -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update((parent_hash or 0).to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    if extra:
        h.update(extra.encode())
    return int.from_bytes(h.digest(), "little")


def hash_prompt_blocks(token_ids: Sequence[int], block_size: int, extra: str = "",
                       start_hashes: Sequence[int] = ()) -> list[int]:
    """Hashes of every full block of token_ids, continuing after start_hashes."""
    hashes = list(start_hashes)
    parent = hashes[-1] if hashes else None
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size], extra)
        hashes.append(parent)
    return hashes
