"""Block identity for prefix caching: a chained SHA-256 over a namespace and each full block's tokens.

Block i's hash covers its own tokens AND (through block i - 1's hash) every token before it, so equal hashes mean
equal K/V. The root carries whatever else changes the content or must not be shared: the model and its dtype, and a
salt (the API key that authenticated the request, OpenAI's `prompt_cache_key`): requests of different tenants never
share blocks, so the time to first token cannot leak another tenant's prompt. SHA-256, not Python's hash(): a
tenant must not be able to craft a prompt whose blocks collide with someone else's.
"""

from __future__ import annotations

import hashlib
import struct


def root_hash(namespace: str, salt: str | None = None) -> bytes:
    """The parent of a request's first block: what its blocks' content depends on besides the tokens."""
    h = hashlib.sha256(b"specserve-prefix-v1\0")
    h.update(namespace.encode())
    h.update(b"\0")
    if salt is not None:
        h.update(b"salt\0" + salt.encode())
    return h.digest()


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(parent + struct.pack(f"<{len(tokens)}q", *tokens)).digest()


def extend_block_hashes(hashes: list[bytes], token_ids: list[int], block_size: int, root: bytes) -> None:
    """Append the hashes of the full blocks of `token_ids` that `hashes` does not cover yet (in place: a request's
    list grows with its tokens, each block hashed once)."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[i - 1] if i else root
        hashes.append(block_hash(parent, token_ids[i * block_size:(i + 1) * block_size]))
