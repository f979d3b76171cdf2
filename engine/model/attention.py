"""Ragged-batch attention over the engine's paged KV cache, plugged into HF models via transformers' AttentionInterface.
Exact for causal softmax with per-layer sliding windows or chunks (recorded at load by specserve.engine.model.support),
logit soft-capping and attention sinks; the per-forward metadata travels in the forward's kwargs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from specserve.engine.model.cpu_kernels import ops as cpu_ops
from specserve.engine.sample.tree import ancestor_matrix, depths
from specserve.engine.sched.kv_cache import KVPool

ATTN_IMPLEMENTATION = "specserve_paged"
PATTERN_ATTR = "specserve_pattern"  # set on each attention module at load: None, ("window", w) or ("chunk", c)
_UNSET = object()

# kwargs transformers passes that do not change the result here (eval mode, one packed row, no HF cache)
_NEUTRAL_KWARGS = {"dropout", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
                   "cu_seqlens", "use_cache", "cache", "output_attentions", "is_causal"}
# other kwargs are flags travelling down the forward (output_router_logits, ...) unless a tensor or named like these
_SEMANTIC_WORDS = ("window", "chunk", "cap", "sink", "bias", "mask", "indices", "scale", "alibi", "block")


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's share of a forward: `num_new` tokens at positions start .. start + num_new - 1."""

    block_table: list[int]
    start: int
    num_new: int
    # a token tree (engine/sample/tree.py): parent of chunk token t >= 1 at index t - 1 (0 = the chunk's first token).
    # Tokens sit in slots start .. start + num_new - 1 in chunk order, at positions start + depth, and attend to
    # the context and their own ancestors only. None: a causal run of tokens.
    parents: tuple[int, ...] | None = None


@dataclass(frozen=True)
class KeyView:
    """The key slots one attention pattern reads, and which of them each query sees."""

    slots: torch.Tensor  # [B, L] flat pool slot of each key (the null block's where the query may not look)
    mask: torch.Tensor  # [B, 1, Qmax, L] bool, True = attend


@dataclass(frozen=True)
class QueryGroup:
    """Sequences of one forward whose queries are padded together to `query_index.shape[1]` rows. A forward splits
    its sequences into short ones (decode, verification) and long ones (prefill chunks), so that a decode row is
    never padded to a prefill chunk's length (that padding made mixed steps several times slower)."""

    kv: KVPool
    block_tables: torch.Tensor  # [B, nb] blocks of each sequence, padded with the null block
    starts: torch.Tensor  # [B] position of each sequence's first new token
    query_index: torch.Tensor  # [B, Qmax] token index of each (sequence, query slot); padding repeats a real token
    query_pos: torch.Tensor  # [B, Qmax] position of each query slot; padding rows repeat the first (never all-masked)
    token_index: torch.Tensor  # [Tg] the forward's token rows this group computes
    output_index: torch.Tensor  # [Tg] their rows in the group's flattened [B * Qmax] output
    max_context: int  # longest start + num_new
    tree_mask: torch.Tensor | None = None  # [B, Qmax, Qmax] which new tokens each new token sees; None: causal
    key_range: torch.Tensor | None = None  # [max_context] 0, 1, ...: the causal key span as a size, not an int
    views: dict = field(default_factory=dict, compare=False)  # pattern -> KeyView, built once per forward

    def key_view(self, pattern: tuple[str, int] | None) -> KeyView:
        """Slots and mask for `pattern`: None (causal), ("window", w) or ("chunk", c); built on first use, so a
        forward builds one mask per distinct pattern, not one per layer."""
        kind, size = pattern or ("causal", 0)
        if kind == "window" and size >= self.max_context:  # the window cannot cut anything in this forward
            kind, size = "causal", 0
        key = (kind, size)
        if key not in self.views:
            self.views[key] = self._build_view(kind, size)
        return self.views[key]

    def _build_view(self, kind: str, size: int) -> KeyView:
        q_max = self.query_pos.shape[1]
        if kind == "causal":  # keys 0 .. max_context - 1 (key_range: a size Dynamo keeps symbolic, unlike an int)
            span = self.key_range if self.key_range is not None else torch.arange(self.max_context,
                                                                                  device=self.starts.device)
            key_pos = span[None, :].expand(self.starts.shape[0], -1)  # [B, L]
        elif kind == "window":  # keys (p - size, p] of the query at position p
            first, length = (self.starts - size + 1).clamp(min=0), min(self.max_context, q_max + size - 1)
            key_pos = first[:, None] + torch.arange(length, device=first.device)  # [B, L]
        elif kind == "chunk":  # keys of p's chunk [p // size * size, p]
            first, length = self.starts // size * size, min(self.max_context, q_max + size - 1)
            key_pos = first[:, None] + torch.arange(length, device=first.device)  # [B, L]
        else:
            raise ValueError(f"unknown attention pattern {kind!r}")
        bs = self.kv.block_size
        q_pos = self.query_pos[:, :, None]  # [B, Qmax, 1]
        mask = key_pos[:, None, :] <= q_pos  # [B, Qmax, L] causal (so never past the sequence's length)
        if kind == "window":
            mask &= key_pos[:, None, :] > q_pos - size
        elif kind == "chunk":
            mask &= key_pos[:, None, :] // size == q_pos // size
        if self.tree_mask is not None:
            if kind != "causal":  # the engine proposes trees only for models without windows or chunks
                raise RuntimeError(f"a token tree reached {kind} attention (trees are verified on causal layers "
                                   "only; the engine should have proposed a chain)")
            mask = self._with_tree(mask)
        seen = mask.any(dim=1)  # [B, L] slots some query of the sequence attends
        block_col = (key_pos // bs).clamp(max=self.block_tables.shape[1] - 1)
        blocks = self.block_tables.gather(1, block_col)  # [B, L]
        slots = torch.where(seen, blocks * bs + key_pos % bs, self.kv.null_block * bs)
        return KeyView(slots, mask[:, None])

    def _with_tree(self, mask: torch.Tensor) -> torch.Tensor:
        """Replace the causal pattern among each sequence's new tokens by tree_mask (one spare column takes the
        padding query slots' entries)."""
        batch, q_max, length = mask.shape
        j = torch.arange(q_max, device=mask.device)[None, :]
        real = self.query_pos - self.starts[:, None] == j  # padding slots repeat the first position
        cols = torch.where(real, self.starts[:, None] + j, torch.full_like(j, length))  # [B, Qmax]
        wide = torch.cat([mask, mask.new_zeros(batch, q_max, 1)], dim=2)
        wide.scatter_(2, cols[:, None, :].expand(batch, q_max, q_max), self.tree_mask & real[:, None, :])
        return wide[..., :length]


@dataclass(frozen=True)
class AttentionMetadata:
    kv: KVPool
    write_slots: torch.Tensor  # [T] flat pool slot (block * block_size + offset) of each new token
    num_tokens: int  # T
    groups: tuple[QueryGroup, ...]
    spare_row: bool = False  # the output has a row T that padding writes to (a compiled forward's stable shapes)
    kernels: object = None  # engine/model/cpu_kernels' library: short query groups run on its attention
    layers_seen: set = field(default_factory=set, compare=False)  # each layer writes its K/V once per forward
    native: dict = field(default_factory=dict, compare=False)  # attention pattern -> the fused layer's view, or None


SHORT_QUERY = 16  # sequences with at most this many new tokens form the short group


def _group(kv: KVPool, tables: torch.Tensor, num_new: torch.Tensor, starts: torch.Tensor, first_token: torch.Tensor,
           members: torch.Tensor, trees: dict, device: torch.device, stable: bool = False,
           scratch: int = 0, min_q: int = 2) -> QueryGroup:
    """The QueryGroup of sequences `members` (indices into the forward's chunks); `trees`: chunk -> [n, n] mask.

    `stable` (a compiled forward): no size of the group is 1 — a lone sequence is repeated, the query width and
    the block-table width are at least 2, and at least 2 output rows, the extra ones written to row `scratch`
    (the forward's spare output row) — so that Dynamo, which specializes sizes of 1, sees one shape class."""
    if stable and len(members) == 1:
        members = members.repeat(2)  # the copy: padding queries only (real[1] below), its outputs gathered by nothing
    tree_mask = None
    if any(int(b) in trees for b in members):
        q = max(int(num_new[members].max()), min_q if stable else 1)
        tree_mask = torch.tril(torch.ones(len(members), q, q, dtype=torch.bool))  # causal members stay causal
        for i, b in enumerate(members.tolist()):
            if b in trees:
                n = trees[b].shape[0]
                tree_mask[i, :n, :n] = trees[b]
                tree_mask[i, n:] = False
                tree_mask[i, n:, 0] = True  # padding query slots see the first new token, as they do causally
        tree_mask = tree_mask.to(device)
    num_new, starts, first = num_new[members], starts[members], first_token[members]
    batch, q_max = len(members), max(int(num_new.max()), min_q if stable else 1)
    ctx_max = int((starts + num_new).max())
    j = torch.arange(q_max)[None, :]  # [1, Qmax]
    real = j < num_new[:, None]  # [B, Qmax]
    if stable and len(members) == 2 and bool(members[0] == members[1]):
        real[1] = False  # the repeated lone sequence
    query_index = torch.where(real, first[:, None] + j, first[:, None])
    q_pos = torch.where(real, starts[:, None] + j, starts[:, None])  # padding rows see a real prefix: no NaN
    flat = torch.arange(batch * q_max).view(batch, q_max)
    token_index, output_index = query_index[real], flat[real]
    if stable and len(token_index) < 2:  # one real row: a second one computes it again into the scratch row
        token_index = torch.cat([token_index, torch.tensor([scratch] * (2 - len(token_index)))])
        output_index = torch.cat([output_index, output_index[:1].expand(2 - len(output_index))])
    width = max(-(-ctx_max // kv.block_size), 2 if stable else 1)
    return QueryGroup(kv=kv, block_tables=tables[members, :width].to(device),
                      starts=starts.to(device), query_index=query_index.to(device), query_pos=q_pos.to(device),
                      token_index=token_index.to(device), output_index=output_index.to(device),
                      max_context=ctx_max, tree_mask=tree_mask,
                      key_range=torch.arange(ctx_max, device=device) if stable else None)


def _stand_in(kv: KVPool, tables: torch.Tensor, scratch: int, min_q: int, device: torch.device) -> QueryGroup:
    """A query group with nothing to compute, for a compiled forward's stable shapes: two rows of `min_q` queries
    of the forward's first token at positions 0 and 1 of the first sequence's blocks (keys this forward or an earlier
    one wrote), every output row sent to the spare row `scratch`."""
    j = torch.arange(min_q)[None, :].expand(2, min_q)
    q_pos = (j < 2) * j  # [[0, 1, 0, ...], [0, 1, 0, ...]]: padding slots repeat position 0
    return QueryGroup(kv=kv, block_tables=tables[[0, 0], :2].to(device), starts=torch.zeros(2, dtype=torch.long,
                      device=device), query_index=torch.zeros(2, min_q, dtype=torch.long, device=device),
                      query_pos=q_pos.to(device), token_index=torch.full((2,), scratch, device=device),
                      output_index=torch.tensor([0, 1], device=device), max_context=2,
                      key_range=torch.arange(2, device=device))


def build_metadata(kv: KVPool, chunks: list[SeqChunk], device: torch.device,
                   stable: bool = False, kernels=None) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata for one ragged forward, plus position ids [T]. Host work is O(B + T) index arithmetic.

    `stable` (a compiled forward): shapes Dynamo need not specialize — both query groups always present (an absent
    one is a _stand_in whose outputs go to a spare row T), and no group size of 1 (_group)."""
    bs = kv.block_size
    num_new = torch.tensor([c.num_new for c in chunks])
    starts = torch.tensor([c.start for c in chunks])
    nb = max(-(-int((starts + num_new).max()) // bs), 2 if stable else 1)
    rows = []
    for b, c in enumerate(chunks):
        if len(c.block_table) * bs < c.start + c.num_new:
            raise RuntimeError(f"sequence {b}: {len(c.block_table)} blocks cannot hold {c.start + c.num_new} tokens")
        blocks = list(c.block_table[:nb])
        rows.append(blocks + [kv.null_block] * (nb - len(blocks)))
    tables = torch.tensor(rows, dtype=torch.long)  # one host tensor for the batch, not one per row
    seq_of_token = torch.repeat_interleave(torch.arange(len(chunks)), num_new)  # [T]
    first_token = torch.cumsum(num_new, 0) - num_new  # [B]
    slot_pos = starts[seq_of_token] + torch.arange(int(num_new.sum())) - first_token[seq_of_token]  # [T]
    positions = slot_pos.clone()  # what the model sees (RoPE): a tree token sits at start + its depth
    trees = {}  # chunk -> [n, n] ancestor mask of its token tree
    for b, c in enumerate(chunks):
        if c.parents is not None:
            anc = ancestor_matrix(torch.tensor([c.parents], dtype=torch.long))[0]  # [n, n]
            trees[b] = anc
            first = int(first_token[b])
            positions[first:first + c.num_new] = c.start + depths(anc[None])[0]
    short = num_new <= SHORT_QUERY
    num_tokens = int(num_new.sum())
    if stable:  # both groups, always (an empty one: a stand-in); the long one's width past SHORT_QUERY either way
        groups = tuple(_group(kv, tables, num_new, starts, first_token, m, trees, device, stable=True,
                              scratch=num_tokens, min_q=min_q) if len(m) else
                       _stand_in(kv, tables, num_tokens, min_q, device)
                       for m, min_q in ((short.nonzero()[:, 0], 2), ((~short).nonzero()[:, 0], SHORT_QUERY + 1)))
    else:
        groups = tuple(_group(kv, tables, num_new, starts, first_token, members, trees, device)
                       for members in (short.nonzero()[:, 0], (~short).nonzero()[:, 0]) if len(members))
    md = AttentionMetadata(kv=kv, write_slots=(tables[seq_of_token, slot_pos // bs] * bs + slot_pos % bs).to(device),
                           num_tokens=num_tokens, groups=groups, spare_row=stable, kernels=kernels)
    return md, positions.to(device)


def _check_call(module, query, key, value, attention_mask, kwargs: dict) -> None:
    """Refuse (never ignore) what this attention does not implement."""
    if attention_mask is not None:
        raise NotImplementedError(f"{type(module).__name__}: a custom attention mask or bias is not supported")
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise NotImplementedError(f"{type(module).__name__}: non-causal attention is not supported")
    unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in _NEUTRAL_KWARGS
                     and (isinstance(v, torch.Tensor) or any(w in k for w in _SEMANTIC_WORDS)))
    if unknown:
        raise NotImplementedError(f"{type(module).__name__}: attention argument(s) {', '.join(unknown)} not supported")
    if key.shape[-1] != value.shape[-1] or query.shape[-1] != key.shape[-1]:
        raise NotImplementedError(f"{type(module).__name__}: query/key/value head sizes differ "
                                  f"({query.shape[-1]}/{key.shape[-1]}/{value.shape[-1]})")


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    specserve_metadata: AttentionMetadata | None = None, softcap=None, s_aux=None, **kwargs):
    """query [1, H, T, D], key/value [1, H_kv, T, D] for the new tokens only -> ([1, T, H, D], None)."""
    md = specserve_metadata
    if md is None:
        raise RuntimeError(f"{type(module).__name__} called without specserve_metadata: the model does not pass "
                           "the forward's kwargs down to its attention")
    pattern = getattr(module, PATTERN_ATTR, _UNSET)
    if pattern is _UNSET:
        raise RuntimeError(f"{type(module).__name__}: no attention pattern recorded; load the model with "
                           "engine.model.loader.load_model (engine.model.support.check_supported records it)")
    kwargs.pop("sliding_window", None)  # the pattern comes from the mask HF builds, which is what eager/SDPA apply
    _check_call(module, query, key, value, attention_mask, kwargs)
    if module.layer_idx in md.layers_seen:
        raise NotImplementedError(f"{type(module).__name__}: attention of layer {module.layer_idx} runs more than "
                                  "once per forward (several attentions or K/V shared per layer)")
    md.layers_seen.add(module.layer_idx)
    k_store, v_store = md.kv.key_store[module.layer_idx], md.kv.value_store[module.layer_idx]
    _, kv_heads, _, head_dim = key.shape
    if k_store.shape[2:] != (kv_heads, head_dim):
        raise RuntimeError(f"layer {module.layer_idx}: K/V of {kv_heads} heads x {head_dim} do not fit the KV pool's "
                           f"{tuple(k_store.shape[2:])}")
    row = kv_heads * head_dim
    k_rows, v_rows = k_store.view(-1, row), v_store.view(-1, row)  # [slots, H_kv * D]: one row per token slot
    k_rows.index_copy_(0, md.write_slots, key[0].transpose(0, 1).reshape(-1, row).to(k_rows.dtype))  # [T] rows
    v_rows.index_copy_(0, md.write_slots, value[0].transpose(0, 1).reshape(-1, row).to(v_rows.dtype))
    q_tokens = query[0].transpose(0, 1)  # [T, H, D]
    heads = q_tokens.shape[1]
    out = q_tokens.new_empty(md.num_tokens + md.spare_row, heads, head_dim)
    for group in md.groups:
        if md.kernels is not None and _kernel_fits(group, q_tokens, k_rows, softcap, s_aux):
            view = group.key_view(pattern)
            scale = scaling if scaling is not None else head_dim ** -0.5
            cpu_ops.attention(md.kernels, q_tokens.contiguous(), k_rows, v_rows, kv_heads, view.slots, view.mask[:, 0],
                              group.token_index, group.output_index, scale, out)
            continue
        out[group.token_index] = _group_attention(group, pattern, q_tokens, k_rows, v_rows, kv_heads, head_dim,
                                                  scaling, softcap, s_aux)
    return (out[: md.num_tokens] if md.spare_row else out)[None], None


def _kernel_fits(group: QueryGroup, q_tokens, k_rows, softcap, s_aux) -> bool:
    """The CPU kernel takes short groups (decode, verification; prefill chunks stay on SDPA, which is faster there)
    without soft-capping or sinks, in fp32 or bf16, with up to 16 query heads per K/V head."""
    return (softcap is None and s_aux is None and group.query_index.shape[1] <= SHORT_QUERY
            and q_tokens.dtype in cpu_ops.DTYPE_CODES and k_rows.dtype in cpu_ops.DTYPE_CODES
            and q_tokens.shape[1] <= cpu_ops.MAX_GROUP * k_rows.shape[1] // q_tokens.shape[2])


def _group_attention(group: QueryGroup, pattern, q_tokens, k_rows, v_rows, kv_heads: int, head_dim: int, scaling,
                     softcap, s_aux) -> torch.Tensor:
    """Attention of one query group -> [Tg, H, D] in the order of group.token_index."""
    view = group.key_view(pattern)
    batch, length = view.slots.shape
    q = q_tokens[group.query_index].transpose(1, 2)  # [B, H, Qmax, D]
    k = k_rows.index_select(0, view.slots.view(-1)).view(batch, length, kv_heads, head_dim)  # [B, L, H_kv, D]
    v = v_rows.index_select(0, view.slots.view(-1)).view(batch, length, kv_heads, head_dim)
    k, v = k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype)  # [B, H_kv, L, D]
    heads = q.shape[1]
    if softcap is None and s_aux is None and not eager_is_faster(q):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=view.mask, scale=scaling,
                                             enable_gqa=heads != kv_heads)  # [B, H, Qmax, D]
    else:
        out = _manual_attention(q, k, v, view.mask, scaling if scaling is not None else head_dim ** -0.5, softcap,
                                s_aux)
    return out.transpose(1, 2).reshape(-1, heads, head_dim)[group.output_index]  # [Tg, H, D]


def eager_is_faster(q: torch.Tensor) -> bool:
    """Short queries in bf16/fp16 on CPU: PyTorch's CPU SDPA kernel (flash, with a mask) measured 5-12x slower than
    the eager math below for decode/verify shapes (2-core EPYC, bf16, 9 heads over 3 KV heads, D 64: batch 16 x 1
    query x 128 keys 2.0 ms vs 0.22 ms per layer; batch 64 x 256 keys 10.6 vs 1.2 ms), while it wins for prefill
    chunks (1 x 256 x 256: 1.6 vs 4.2 ms) and in fp32. The eager math is HF's eager attention: scores in the model's
    dtype, softmax in fp32."""
    return q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16) and q.shape[2] <= SHORT_QUERY


def _manual_attention(q, k, v, mask, scaling: float, softcap: float | None, sinks: torch.Tensor | None):
    """Softmax attention with tanh soft-capped logits and/or a per-head sink logit (gpt-oss), as HF's eager path:
    q [B, H, Q, D], k/v [B, H_kv, L, D], mask [B, 1, Q, L] -> [B, H, Q, D]."""
    batch, heads, q_len, head_dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads  # query head h reads K/V head h // group
    qg = q.reshape(batch, kv_heads, group * q_len, head_dim)  # [B, H_kv, G * Q, D]
    scores = (qg @ k.transpose(2, 3)).view(batch, heads, q_len, -1) * scaling  # [B, H, Q, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype).view(1, heads, 1, 1).expand(batch, heads, q_len, 1)
        scores = torch.cat([scores, sink], dim=-1)  # [B, H, Q, L + 1]
        scores = scores - scores.max(dim=-1, keepdim=True).values
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    if sinks is not None:
        probs = probs[..., :-1]  # the sink takes probability mass and contributes no value
    out = probs.reshape(batch, kv_heads, group * q_len, -1) @ v  # [B, H_kv, G * Q, D]
    return out.view(batch, heads, q_len, head_dim)


def register_attention() -> None:
    """Idempotent: make the paged attention selectable by name in transformers."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
