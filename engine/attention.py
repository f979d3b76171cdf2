"""Ragged-batch attention over the engine's paged KV cache, plugged into HF models via transformers'
AttentionInterface. The per-forward metadata travels in the forward's kwargs (registration is process-global)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from engine.kv_cache import KVPool

ATTN_IMPLEMENTATION = "specserve_paged"


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's share of a forward: `num_new` tokens at positions start .. start + num_new - 1."""

    block_table: list[int]
    start: int
    num_new: int


@dataclass(frozen=True)
class AttentionMetadata:
    kv: KVPool
    write_blocks: torch.Tensor  # [T] block of each new token
    write_offsets: torch.Tensor  # [T] offset inside that block
    gather_blocks: torch.Tensor  # [B, nb] blocks of each sequence (padded with block 0, masked out)
    query_index: torch.Tensor  # [B, Qmax] token index of each (sequence, query slot); padding repeats a real token
    mask: torch.Tensor  # [B, 1, Qmax, nb * block_size] bool, True = attend (causal within each sequence)
    output_index: torch.Tensor  # [T] row of each token in the flattened [B * Qmax] output


def build_metadata(kv: KVPool, chunks: list[SeqChunk], device: torch.device) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata for one ragged forward, plus position ids [T]. Host work is O(B + T) index arithmetic."""
    bs = kv.block_size
    num_new = torch.tensor([c.num_new for c in chunks])
    starts = torch.tensor([c.start for c in chunks])
    batch, q_max = len(chunks), int(num_new.max())
    ctx_max = int((starts + num_new).max())
    nb = -(-ctx_max // bs)
    tables = torch.zeros(batch, nb, dtype=torch.long)
    for b, c in enumerate(chunks):
        blocks = c.block_table[:nb]
        tables[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
    seq_of_token = torch.repeat_interleave(torch.arange(batch), num_new)  # [T]
    first_token = torch.cumsum(num_new, 0) - num_new  # [B]
    slot = torch.arange(int(num_new.sum())) - first_token[seq_of_token]  # [T] index within its sequence
    positions = starts[seq_of_token] + slot  # [T]
    j = torch.arange(q_max)[None, :]  # [1, Qmax]
    real = j < num_new[:, None]  # [B, Qmax]
    query_index = torch.where(real, first_token[:, None] + j, first_token[:, None])
    q_pos = torch.where(real, starts[:, None] + j, starts[:, None])  # padding rows see a real prefix: no NaN
    key_pos = torch.arange(nb * bs)
    mask = (key_pos[None, None, :] <= q_pos[:, :, None])[:, None]  # [B, 1, Qmax, L]
    md = AttentionMetadata(
        kv=kv,
        write_blocks=tables[seq_of_token, positions // bs].to(device),
        write_offsets=(positions % bs).to(device),
        gather_blocks=tables.to(device),
        query_index=query_index.to(device),
        mask=mask.to(device),
        output_index=(seq_of_token * q_max + slot).to(device),
    )
    return md, positions.to(device)


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    specserve_metadata: AttentionMetadata | None = None, **kwargs):
    """query [1, H, T, D], key/value [1, H_kv, T, D] for the new tokens only -> ([1, T, H, D], None)."""
    md = specserve_metadata
    if md is None:
        raise RuntimeError("specserve attention called without specserve_metadata")
    k_cache, v_cache = md.kv.key[module.layer_idx], md.kv.value[module.layer_idx]
    k_cache[md.write_blocks, md.write_offsets] = key[0].transpose(0, 1).to(k_cache.dtype)  # [T, H_kv, D]
    v_cache[md.write_blocks, md.write_offsets] = value[0].transpose(0, 1).to(v_cache.dtype)
    batch, nb = md.gather_blocks.shape
    _, kv_heads, _, head_dim = key.shape
    k = k_cache[md.gather_blocks].view(batch, -1, kv_heads, head_dim).transpose(1, 2)  # [B, H_kv, L, D]
    v = v_cache[md.gather_blocks].view(batch, -1, kv_heads, head_dim).transpose(1, 2)
    q = query[0].transpose(0, 1)[md.query_index].transpose(1, 2)  # [B, H, Qmax, D]
    heads = q.shape[1]
    out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=md.mask, scale=scaling,
                                         enable_gqa=heads != kv_heads)  # [B, H, Qmax, D]
    out = out.transpose(1, 2).reshape(-1, heads, head_dim)[md.output_index]  # [T, H, D]
    return out[None], None


def register_attention() -> None:
    """Idempotent: make the paged attention selectable by name in transformers."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
