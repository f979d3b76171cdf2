"""EAGLE-3 proposer: a one-layer drafter over the target's own hidden states (engine/spec_decode/eagle3/model.py).

State per request, in two paged pools under the target's block ids (rollback is O(1), preemption drops them with
the target's blocks, prefix caching shares them):
- features: g_t = fc(target hidden states of the 3 layers at position t), written for every kept token as the
  target's forward hands them over (prefill chunks too; a verify row's accepted path only);
- the drafter's K/V at position t, made from the real pair (g_{t-1}, token t) when the request next proposes.
A proposal runs one catch-up forward over the pairs not yet seen (its last row drafts the first token), then one
forward per further depth for the whole batch, each row reading its parent's output as its hidden input. The
pool only ever holds real pairs: the prefix's K/V is gathered once per proposal and drafted rows' K/V stay in a
per-proposal buffer, each row attending to the real prefix, its ancestors and itself.
- Chains: draft tokens are drawn from q (the drafter's distribution processed as the request asks; one-hot when
  greedy), so verification stays exact.
- Trees (`speculative_eagle_topk` > 1; batches without grammars or logit_bias): EAGLE-2's dynamic tree
  (eagle3/tree.py) of one-hot candidates, verified by the tree rule.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specserve.config.schema import SpeculativeMethodConfig
from specserve.engine.model.loader import DEMO_EAGLE3_DIR, bundled_for_demo, release_freed_memory
from specserve.engine.model.cpu_kernels.build import for_device
from specserve.engine.model.quantize import quantize_linears
from specserve.engine.request import Request
from specserve.engine.sched.kv_cache import KVPool, kv_bytes_per_token, slot_table, zeroed
from specserve.engine.spec_decode.base import HiddenChunk, Proposal, ProposerBase, ProposerContext, ProposerNeeds
from specserve.engine.spec_decode.draft_sampling import ChainSampler
from specserve.engine.spec_decode.eagle3.model import Eagle3Drafter, load_drafter
from specserve.engine.spec_decode.eagle3.tree import DynamicTree

_BROKEN = -1  # a request whose features have a gap (never expected): it stops proposing until recomputed


def drafter_directory(cfg: SpeculativeMethodConfig, ctx: ProposerContext) -> Path:
    """--draft-model, else the bundled drafter of the demo target."""
    if cfg.model:
        path = Path(cfg.model).expanduser()
        if not path.is_dir():
            raise ValueError(f"draft_model: {cfg.model} is not a directory (an EAGLE-3 drafter: config.json + "
                             "model.safetensors)")
        return path
    bundled = bundled_for_demo(ctx.target_path, DEMO_EAGLE3_DIR)
    if bundled is not None and bundled.is_dir():
        return bundled
    raise ValueError("draft_model: speculative method 'eagle3' needs a drafter: pass --draft-model DIR (the "
                     "speculators format or the EAGLE authors'; train one with `specserve train eagle3`)")


class Eagle3Proposer(ProposerBase):
    name = "eagle3"

    def __init__(self, drafter: Eagle3Drafter, embed: torch.nn.Module, vocab_size: int, device: torch.device,
                 dtype: torch.dtype, num_speculative_tokens: int, topk: int = 1):
        # HF's hidden_states[i] (the input of target layer i) is the output of decoder layer i - 1: our tap id
        self.taps = tuple(i - 1 for i in drafter.format.layer_ids)  # low, mid, high
        self.topk = topk  # > 1: dynamic trees
        super().__init__(ProposerNeeds(hidden_layers=tuple(sorted(set(self.taps))), hidden_rows="all",
                                       returns_probs=True, tree=topk > 1, prefix_kv="target"), num_speculative_tokens)
        self.drafter, self.embed, self.vocab_size = drafter, embed, vocab_size
        self.device, self.dtype = device, dtype
        self.draft_to_target = drafter.draft_to_target  # [Vd]
        self.kv: KVPool | None = None  # once bind_kv sized the pools
        self.features: torch.Tensor | None = None  # [num_blocks + 1, block_size, H]
        self._mappings: list = []
        self._feat: dict[str, int] = {}  # request id -> leading positions whose features are in the pool
        self._kv: dict[str, int] = {}  # request id -> leading positions whose drafter K/V is valid (0 counts)

    @classmethod
    def load(cls, cfg: SpeculativeMethodConfig, ctx: ProposerContext) -> "Eagle3Proposer":
        drafter = load_drafter(drafter_directory(cfg, ctx), ctx.target_config, ctx.dtype, ctx.device)
        if ctx.quantization is not None:  # its linears (fc, the layer, its head) on the same kernels as the target's
            quantize_linears(drafter, ctx.quantization, ctx.dtype, skip=(), kernels=for_device(ctx.device))
            release_freed_memory()
        embed = drafter.embed_tokens if drafter.embed_tokens is not None else ctx.input_embeddings
        if embed is None:
            raise ValueError("speculative_method: eagle3 shares the target's token embedding, which this target does "
                             "not expose (and the drafter brings none)")
        topk = cfg.speculative_eagle_topk if ctx.tree_attention else 1  # a target that cannot verify trees: chains
        return cls(drafter, embed, ctx.vocab_size, ctx.device, ctx.dtype, cfg.k_max, topk)

    def kv_bytes_per_token(self) -> int:
        feature = self.drafter.config.hidden_size * torch.empty((), dtype=self.dtype).element_size()
        return kv_bytes_per_token(self.drafter.config, self.dtype) + feature

    def bind_kv(self, num_blocks: int, block_size: int) -> None:
        self.kv = KVPool.allocate(self.drafter.config, num_blocks, block_size, self.dtype, self.device)
        shape = (num_blocks + 1, block_size, self.drafter.config.hidden_size)  # + the null block
        self.features = zeroed(shape, self.dtype, self.device, self._mappings)

    # -- features -------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def on_hidden(self, requests: list[Request], chunks: list[HiddenChunk]) -> None:
        """Fuse every handed-over position's three hidden states into g (one batched fc per step) and keep it."""
        feats, slots = [], []
        bs = self.kv.block_size
        for req, chunk in zip(requests, chunks):
            n = next(iter(chunk.states.values())).shape[0]
            have = self._feat.get(req.request_id, 0)
            if have == _BROKEN or chunk.start > have:
                self._feat[req.request_id] = _BROKEN
                continue
            self._feat[req.request_id] = chunk.start + n
            pos = torch.arange(chunk.start, chunk.start + n)
            feats.append(torch.cat([chunk.states[i] for i in self.taps], dim=-1))  # [n, 3H]
            slots.append(torch.tensor(req.block_ids)[pos // bs] * bs + pos % bs)
        if feats:
            g = self.drafter.fc(torch.cat(feats).to(self.dtype))  # [N, H]
            self.features.view(-1, self.features.shape[-1]).index_copy_(0, torch.cat(slots).to(self.device), g)

    # -- drafting -------------------------------------------------------------------------------------------------

    def propose(self, requests: list[Request], ks: list[int], default_generator: torch.Generator) -> Proposal:
        live = [i for i, r in enumerate(requests) if self._feat.get(r.request_id, 0) >= len(r.token_ids) - 1 > 0]
        if len(live) == len(requests):  # the usual case: no second [S, K, V] buffer
            return self._draft(requests, ks, default_generator)
        ids = torch.full((len(requests), max(ks)), -1, dtype=torch.long, device=self.device)
        probs = torch.zeros(len(requests), max(ks), self.vocab_size, device=self.device)
        counts = [0] * len(requests)
        parents: list[list[int]] = [[] for _ in requests]
        if not live:
            return Proposal(ids, counts, probs)
        sub = self._draft([requests[i] for i in live], [ks[i] for i in live], default_generator)
        index = torch.tensor(live, device=self.device)
        ids[index, : sub.token_ids.shape[1]] = sub.token_ids
        if sub.probs is not None:
            probs[index, : sub.token_ids.shape[1]] = sub.probs
        for j, (i, n) in enumerate(zip(live, sub.num_tokens)):
            counts[i] = n
            parents[i] = sub.parents[j] if sub.parents is not None else []
        if sub.parents is None:
            return Proposal(ids, counts, probs)
        return Proposal(ids, counts, None, parents)

    @torch.inference_mode()
    def _draft(self, requests: list[Request], ks: list[int], default_generator: torch.Generator) -> Proposal:
        last, h_last = self._catch_up(requests)
        if self.topk > 1 and not any(r.grammar is not None or r.params.logit_bias for r in requests):
            return self._tree(requests, ks, last, h_last)
        chain = ChainSampler(requests, ks, self.vocab_size, self.device, default_generator)
        k_pre, v_pre, visible = self._prefix_kv(requests, [n + 1 for n in last])
        drafted_k: list[torch.Tensor] = []  # per depth [S, 1, kv_heads, D]; rows that stopped earlier stay zero
        drafted_v: list[torch.Tensor] = []
        for depth in range(max(ks)):
            drafted = chain.draw(depth, self._target_logits(h_last))
            keep = chain.advance(depth)
            if not keep:
                break
            keep_idx = torch.tensor(keep, device=self.device)
            rows = torch.tensor(chain.active, device=self.device)  # the requests drafting another token
            pos = torch.tensor([last[a] + 1 + depth for a in chain.active], device=self.device)[:, None]
            emb = self.embed(drafted[keep_idx][:, None]).to(self.dtype)
            q, k, v, residual = self.drafter.kv_and_query(emb, h_last[keep_idx][:, None].to(self.dtype), pos)
            drafted_k.append(k.new_zeros(len(requests), *k.shape[1:]).index_copy_(0, rows, k))
            drafted_v.append(v.new_zeros(len(requests), *v.shape[1:]).index_copy_(0, rows, v))
            keys = torch.cat([k_pre[rows]] + [d[rows] for d in drafted_k], dim=1)
            values = torch.cat([v_pre[rows]] + [d[rows] for d in drafted_v], dim=1)
            own = torch.ones(len(rows), depth + 1, dtype=torch.bool, device=self.device)  # its chain, itself last
            mask = torch.cat([visible[rows], own], dim=1)[:, None, :]
            h_last = self.drafter.attend_and_finish(q, keys, values, residual, mask)[:, 0]
        return chain.proposal()

    def _catch_up(self, requests: list[Request]) -> tuple[list[int], torch.Tensor]:
        """The real pairs (g_{t-1}, token t) for t = first .. the last token's position -> (each request's last
        position, the last row's output h_last [S, H]: what drafts the first token)."""
        last = [len(r.token_ids) - 1 for r in requests]
        first = [max(1, self._kv.get(r.request_id, 1)) for r in requests]
        tokens = [r.token_ids[f: n + 1] for r, f, n in zip(requests, first, last)]
        hidden = self._gather_features(requests, first, [n + 1 - f for f, n in zip(first, last)])
        h_out = self._forward(requests, first, tokens, hidden)  # [S, Q, H]
        for r, n in zip(requests, last):
            self._kv[r.request_id] = n + 1
        rows = torch.tensor([n - f for f, n in zip(first, last)], device=self.device)
        return last, h_out[torch.arange(len(requests), device=self.device), rows]

    def _tree(self, requests: list[Request], ks: list[int], last: list[int], h_last: torch.Tensor) -> Proposal:
        """A dynamic tree per request (eagle3/tree.py), one drafter forward per depth over every row's frontier."""
        s, dev = len(requests), self.device
        tree = DynamicTree(self._draft_logp(h_last), self.topk)
        k_pre, v_pre, visible = self._prefix_kv(requests, [n + 1 for n in last])
        keys, values = [k_pre], [v_pre]
        w = self.topk
        ancestors = torch.zeros(s, w, 0, dtype=torch.bool, device=dev)  # frontier row -> drafted rows above it
        front_h = h_last[:, None].expand(s, w, h_last.shape[-1])
        budgets = torch.tensor(ks, device=dev)
        for depth in range(max(ks) - 1):
            if tree.done(budgets):
                break
            pos = (torch.tensor(last, device=dev) + 1 + depth)[:, None].expand(s, w)
            emb = self.embed(self.draft_to_target[tree.front_tokens]).to(self.dtype)
            q, k, v, residual = self.drafter.kv_and_query(emb, front_h.to(self.dtype), pos)
            keys.append(k)
            values.append(v)
            own = torch.cat([ancestors, torch.eye(w, dtype=torch.bool, device=dev).expand(s, w, w)], dim=-1)
            mask = torch.cat([visible[:, None, :].expand(s, w, visible.shape[1]), own], dim=-1)
            h_out = self.drafter.attend_and_finish(q, torch.cat(keys, dim=1), torch.cat(values, dim=1), residual,
                                                   mask)  # [S, w, H]
            tree.expand(self._draft_logp(h_out))
            rows = tree.front_rows  # each new frontier node's parent row
            front_h = h_out.gather(1, rows[..., None].expand(-1, -1, h_out.shape[-1]))
            ancestors = own.gather(1, rows[..., None].expand(-1, -1, own.shape[-1]))
        tokens, parents = tree.select(ks)
        ids = torch.full((s, max(ks)), -1, dtype=torch.long)
        to_target = self.draft_to_target.cpu()  # one copy per proposal, not one per request
        for i, t in enumerate(tokens):
            ids[i, : len(t)] = to_target[torch.tensor(t, dtype=torch.long)]
        return Proposal(ids.to(dev), [len(t) for t in tokens], None, parents)

    def _draft_logp(self, h: torch.Tensor) -> torch.Tensor:
        """[..., H] drafter outputs -> [..., Vd] log-probabilities over the draft vocabulary."""
        return torch.log_softmax(self.drafter.logits(h).float(), dim=-1)

    def _prefix_kv(self, requests: list[Request], lengths: list[int]):
        """The drafter's K/V of positions 0 .. lengths - 1 of each request -> (K, V [S, L, kv_heads, D], the keys a
        drafted row may attend [S, L]: real positions >= 1)."""
        slots, real = slot_table([r.block_ids for r in requests], torch.zeros(len(requests), dtype=torch.long),
                                 torch.tensor(lengths), self.kv.block_size, self.kv.null_block)
        flat_slots = slots.view(-1).to(self.device)
        out = []
        for store in (self.kv.key_store[0], self.kv.value_store[0]):
            flat = store.view(-1, *store.shape[2:])
            out.append(flat.index_select(0, flat_slots).view(*slots.shape, *flat.shape[1:]))
        visible = real.to(self.device) & (torch.arange(slots.shape[1], device=self.device) >= 1)[None, :]
        return out[0], out[1], visible

    def _target_logits(self, h: torch.Tensor) -> torch.Tensor:
        """[A, H] drafter outputs -> [A, V] logits over the target vocabulary (-inf outside the draft vocabulary)."""
        draft = self.drafter.logits(h).float()  # [A, Vd]
        full = torch.full((h.shape[0], self.vocab_size), float("-inf"), device=self.device)
        full[:, self.draft_to_target] = draft
        return full

    def _gather_features(self, requests: list[Request], first: list[int], counts: list[int]) -> torch.Tensor:
        """g at positions first - 1 .. first + count - 2 of each request -> [S, Q, H] (padding: the null block)."""
        starts = torch.tensor(first) - 1
        slots, _ = slot_table([r.block_ids for r in requests], starts, torch.tensor(counts), self.kv.block_size,
                              self.kv.null_block)
        flat = self.features.view(-1, self.features.shape[-1])
        return flat.index_select(0, slots.view(-1).to(self.device)).view(*slots.shape, -1)

    def _forward(self, requests: list[Request], first: list[int], tokens: list[list[int]],
                 hidden: torch.Tensor) -> torch.Tensor:
        """Rows at positions first[i] .. first[i] + len(tokens[i]) - 1 of each request, with those tokens and hidden
        inputs [S, Q, H] (the catch-up: real pairs only): their K/V written to the pool, attention over positions
        1 .. (earlier rows included).
        -> h_out [S, Q, H]."""
        s, q_len = len(requests), hidden.shape[1]
        counts = torch.tensor([len(t) for t in tokens])
        ids = torch.zeros(s, q_len, dtype=torch.long)
        for i, t in enumerate(tokens):
            ids[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        starts = torch.tensor(first)
        q_pos = (starts[:, None] + torch.arange(q_len)[None, :]).to(self.device)  # [S, Q]
        emb = self.embed(ids.to(self.device)).to(self.dtype)
        q, k, v, residual = self.drafter.kv_and_query(emb, hidden.to(self.dtype), q_pos)
        new_slots, new_real = slot_table([r.block_ids for r in requests], starts, counts, self.kv.block_size,
                                         self.kv.null_block)
        valid = new_real.view(-1).to(self.device)
        for store, rows in ((self.kv.key_store[0], k), (self.kv.value_store[0], v)):
            flat = store.view(-1, *store.shape[2:])
            flat.index_copy_(0, new_slots.view(-1)[new_real.view(-1)].to(self.device),
                             rows.reshape(-1, *rows.shape[2:])[valid].to(store.dtype))
        # keys: positions 0 .. last row of each request, slot 0 never attended (no pair ends there)
        k_all, v_all, visible = self._prefix_kv(requests, (starts + counts).tolist())
        key_pos = torch.arange(k_all.shape[1], device=self.device)[None, :]
        mask = (key_pos[:, None, :] <= q_pos[:, :, None]) & visible[:, None, :]  # [S, Q, L] causal
        mask |= key_pos[:, None, :] == q_pos[:, :, None]  # a padded row still sees itself (its output is unused)
        return self.drafter.attend_and_finish(q, k_all, v_all, residual, mask)

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def on_preempt(self, request: Request) -> None:
        self._feat.pop(request.request_id, None)  # its blocks are gone: the recomputed prefill refills them
        self._kv.pop(request.request_id, None)

    def on_free(self, request: Request) -> None:
        self.on_preempt(request)

    def kv_valid_tokens(self, request: Request) -> int:
        feat = self._feat.get(request.request_id, 0)
        return 0 if feat == _BROKEN else min(feat, self._kv.get(request.request_id, 0))

    def on_cache_hit(self, request: Request, num_tokens: int) -> None:
        self._feat[request.request_id] = num_tokens  # features and drafter K/V of the shared blocks are valid
        self._kv[request.request_id] = max(1, num_tokens)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        self.kv.copy_blocks(src, dst)
        s, d = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
        self.features.index_copy_(0, d, self.features.index_select(0, s))
