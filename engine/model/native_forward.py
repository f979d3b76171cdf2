"""A Llama-family causal LM's whole forward without transformers' model code around it, for steps the one-call
decoder (fast_layers.NativeStack) runs: embedding, rotary tables, the decoder in one kernel call, final norm, the head
on the rows wanted. The same modules in the same order as LlamaForCausalLM.forward (Mistral's and Qwen2's compute the
same), so the same logits bit for bit; what it leaves out is the per-call glue (decorators, output records, mask
creation, 30 layers' pass-through calls): ~1.4 ms of a 12.6 ms 4-stream int4 step on a 2-core Xeon before it.
Forwards without token trees or windows also skip build_metadata: their attention view comes straight from the chunks
(causal_groups). Measured: python -m bench.native_forward (docs/benchmarks.md, issue 34)."""

from __future__ import annotations

from itertools import accumulate

import torch

from specserve.engine.model.attention import PATTERN_ATTR, SHORT_QUERY, AttentionMetadata, SeqChunk
from specserve.engine.model.fast_layers import NATIVE_QUERY, NativeStack, _forward
from specserve.engine.model.hidden import decoder_layers
from specserve.engine.sched.kv_cache import KVPool

# causal LM -> its base model, whose forward is embed -> rotary -> layers -> norm (-> the head on kept rows); the masks
# Qwen2's and Mistral's forwards also build are None under the engine's attention (it refuses any other), and their
# windows travel in the layers' attention patterns, which the kernels' view applies
MODELS = {"LlamaForCausalLM": "LlamaModel", "MistralForCausalLM": "MistralModel", "Qwen2ForCausalLM": "Qwen2Model"}


class NativeForward:
    """Built for a model whose every layer is in one NativeStack (`of`); `forward` -> logits, or None when this
    forward is not one for the stack (a long query group, a hook on the model, a layer whose forward is not
    the engine's) and transformers' forward must run."""

    def __init__(self, model, stack: NativeStack):
        self.model, self.stack, self.layers = model, stack, stack.layers
        self.pattern = getattr(self.layers[0].self_attn, PATTERN_ATTR, None)

    @staticmethod
    def of(model) -> NativeForward | None:
        if MODELS.get(type(model).__name__) != type(getattr(model, "model", None)).__name__:
            return None
        try:
            layers = decoder_layers(model)
        except ValueError:
            return None
        stack = getattr(layers[0], "specserve_stack", None)
        if stack is None or list(stack.layers) != list(layers) or len(layers) != model.config.num_hidden_layers:
            return None
        return NativeForward(model, stack)

    def _modules(self) -> tuple | None:
        """(embedding, rotary tables, final norm, head) as the model holds them now (a Q8 head may replace the
        head after loading; they are called as modules, so their own hooks run), or None when something hooks the
        model or its base model (which this forward does not call) or the stack's path."""
        model = self.model
        base = model.model
        if (model._forward_hooks or model._forward_pre_hooks or base._forward_hooks or base._forward_pre_hooks
                or not all(getattr(layer.forward, "__func__", None) is _forward for layer in self.layers)
                or not self.stack.usable()):
            return None
        return base.embed_tokens, base.rotary_emb, base.norm, model.lm_head

    def forward_causal(self, input_ids: torch.Tensor, kv: KVPool, chunks: list[SeqChunk], logits_index: torch.Tensor,
                       kernels) -> torch.Tensor | None:
        """forward() for chunks without token trees on a model without windows, its attention view built straight
        from the chunks (causal_groups) instead of from build_metadata's query groups; None as forward()."""
        if (kernels is None or self.pattern is not None or max(c.num_new for c in chunks) > NATIVE_QUERY
                or any(c.parents is not None for c in chunks)):
            return None
        modules = self._modules()
        if modules is None:
            return None
        groups, write_slots, positions = causal_groups(kv, chunks)
        md = AttentionMetadata(kv=kv, write_slots=write_slots, num_tokens=len(positions), groups=(), kernels=kernels)
        return self._run(modules, input_ids, positions, md, logits_index, groups)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                logits_index: torch.Tensor) -> torch.Tensor | None:
        """input_ids, positions [T], logits_index [N] -> logits [N, V] as transformers' forward returns them."""
        if md.kernels is None or not all(g.query_index.shape[1] <= NATIVE_QUERY for g in md.groups):
            return None  # a long prefill chunk: the layers' op-by-op forwards (SDPA)
        modules = self._modules()
        return None if modules is None else self._run(modules, input_ids, positions, md, logits_index, None)

    def _run(self, modules: tuple, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
             logits_index: torch.Tensor, groups: list | None) -> torch.Tensor | None:
        """`groups`: the attention view's query groups where md carries none (forward_causal)."""
        embed, rotary, norm, head = modules
        hidden = embed(input_ids[None])
        native = self.layers[0].specserve_native
        if not native.usable(hidden, md, None):
            return None
        cos, sin = rotary(hidden, position_ids=positions[None])
        if groups is None:
            view = native.forward_view(md, self.pattern, cos, sin)
        else:
            view = native.view_of(md.num_tokens, groups, cos, sin, md.write_slots) if cos.dtype == native.dtype \
                else None
        out = None if view is None else self.stack.run(md, view, hidden)
        if out is None:
            return None
        return head(norm(out)[:, logits_index, :])[0]


def causal_groups(kv: KVPool, chunks: list[SeqChunk]) -> tuple[list[tuple], torch.Tensor, torch.Tensor]:
    """For chunks without token trees, attention without windows: the C view's query groups (slots [B, L], mask
    [B, Qmax, L], token_index, output_index; short and long sequences apart, as build_metadata groups them), the K/V
    write slots [T] and the positions [T] — the arrays build_metadata and QueryGroup.key_view give, from a handful of
    tensor operations (tests/unit/test_native_view.py holds them equal)."""
    bs, null = kv.block_size, kv.null_block
    num_new, starts = [c.num_new for c in chunks], [c.start for c in chunks]
    ends = [s + n for s, n in zip(starts, num_new)]
    width = -(-max(ends) // bs)
    rows = []
    for b, (c, end) in enumerate(zip(chunks, ends)):
        if len(c.block_table) * bs < end:
            raise RuntimeError(f"sequence {b}: {len(c.block_table)} blocks cannot hold {end} tokens")
        blocks = list(c.block_table[:width])
        rows.append(blocks + [null] * (width - len(blocks)))
    first = list(accumulate(num_new, initial=0))
    positions = [s + j for s, n in zip(starts, num_new) for j in range(n)]
    write_slots = [rows[b][p // bs] * bs + p % bs
                   for b, (s, n) in enumerate(zip(starts, num_new)) for p in range(s, s + n)]
    tables = torch.tensor(rows, dtype=torch.long)  # [B, width]
    groups = []
    for members in ([b for b, n in enumerate(num_new) if n <= SHORT_QUERY], [b for b, n in enumerate(num_new)
                                                                             if n > SHORT_QUERY]):
        if not members:
            continue
        q_max, length = max(num_new[b] for b in members), max(ends[b] for b in members)
        start = torch.tensor([starts[b] for b in members])[:, None]  # [Bg, 1]
        count = torch.tensor([num_new[b] for b in members])[:, None]
        key = torch.arange(length)  # [L]
        slots = tables[members][:, key // bs] * bs + key % bs  # [Bg, L]
        slots = torch.where(key < start + count, slots, null * bs)  # keys no query sees: the null block's
        j = torch.arange(q_max)
        q_pos = torch.where(j < count, start + j, start)  # [Bg, Qmax]; padding rows repeat the first position
        mask = key[None, None, :] <= q_pos[:, :, None]  # [Bg, Qmax, L]
        token_index = torch.tensor([first[b] + i for b in members for i in range(num_new[b])])
        output_index = torch.tensor([g * q_max + i for g, b in enumerate(members) for i in range(num_new[b])])
        groups.append((slots, mask, token_index, output_index))
    return groups, torch.tensor(write_slots, dtype=torch.long), torch.tensor(positions, dtype=torch.long)
