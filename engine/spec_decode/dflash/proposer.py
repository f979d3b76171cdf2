"""DFlash proposer: a block-diffusion drafter (engine/spec_decode/dflash/model.py) fills a block [last token, MASK x (B
- 1)] in ONE forward for the whole batch, reading context K/V made from the target's own hidden states; its drafts are
the argmax at each block position (one-hot), so the ordinary verification keeps output exact at any temperature.

Context K/V: after every target forward the engine hands over the hidden states (at the drafter's target layers)
of every token whose target K/V was kept — prefill chunks included, a verify row's accepted path only — and they
are projected at once (fc, norm, each layer's k/v projection, RoPE) into the drafter's own paged pool, indexed by
the target's block ids. Rejected drafts never reach it; positions past a request's kept length are never read (the
null block stands in), so rollback costs nothing; a preemption drops the pool's blocks with the target's, and the
recomputed prefill refills them. A request proposes only when its context reaches its last token's position.

The drafter always runs the block size it was trained at (a shorter k uses the block's first k positions: the
masks behind them are what it saw in training); the LM head (the target's, optionally restricted to a candidate
vocabulary) runs only over the positions some row asked for.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specserve.config.schema import SpeculativeMethodConfig
from specserve.engine.model.hidden import FINAL
from specserve.engine.model.loader import DEMO_DFLASH_DIR, bundled_for_demo
from specserve.engine.request import Request
from specserve.engine.sched.kv_cache import KVPool, kv_bytes_per_token
from specserve.engine.spec_decode.base import (
    HiddenChunk,
    Proposal,
    ProposerBase,
    ProposerContext,
    ProposerNeeds,
    VerifiedRow,
)
from specserve.engine.spec_decode.dflash.model import block_masks, check_against_target, load_drafter

_BROKEN = -1  # a request whose context has a gap (never expected): it stops proposing until recomputed


def drafter_directory(cfg: SpeculativeMethodConfig, ctx: ProposerContext) -> Path:
    """--draft-model, else the bundled drafter of the demo target."""
    if cfg.model:
        path = Path(cfg.model).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"draft_model: no DFlash drafter directory at {cfg.model}")
        return path
    bundled = bundled_for_demo(ctx.target_path, DEMO_DFLASH_DIR)
    if bundled is not None and bundled.is_dir():
        return bundled
    raise ValueError("draft_model: speculative method 'dflash' needs a drafter: pass --draft-model DIR (a DFlash "
                     "checkpoint; train one with `specserve train dflash`)")


class DFlashProposer(ProposerBase):
    name = "dflash"

    def __init__(self, drafter, embed: torch.nn.Module, lm_head: torch.Tensor, device: torch.device,
                 dtype: torch.dtype, num_speculative_tokens: int, vocab_ids: torch.Tensor | None = None,
                 num_target_layers: int | None = None):
        """lm_head [V or Vc, H]: the target's output embedding (rows `vocab_ids` [Vc] only, when given)."""
        self.drafter = drafter
        self.embed = embed
        self.lm_head = lm_head
        self.vocab_ids = vocab_ids
        self.device, self.dtype = device, dtype
        self.block_size = drafter.block_size
        # HF's hidden_states[L] (what a checkpoint trained on hidden_states[i + 1] read for its last layer) is the
        # final norm's output, not the last decoder layer's: specserve.engine.model.hidden's id -1
        last = num_target_layers - 1 if num_target_layers else None
        self.layers = tuple(FINAL if i == last else i for i in drafter.target_layer_ids)
        super().__init__(ProposerNeeds(hidden_layers=tuple(sorted(set(self.layers))), hidden_rows="all",
                                       cost_per_step=True, prefix_kv="target"), num_speculative_tokens)
        self.kv: KVPool | None = None  # once bind_kv sized it
        self._valid: dict[str, int] = {}  # request id -> positions 0 .. n - 1 whose context K/V are in the pool

    @classmethod
    def load(cls, cfg: SpeculativeMethodConfig, ctx: ProposerContext) -> "DFlashProposer":
        if ctx.lm_head is None or ctx.input_embeddings is None:
            raise ValueError("speculative_method: dflash shares the target's embedding and LM head, which this "
                             "target does not expose")
        directory = drafter_directory(cfg, ctx)
        drafter, ids = load_drafter(directory, ctx.dtype, ctx.device)
        check_against_target(drafter, ctx.target_config, ctx.vocab_size)
        longest = drafter.block_size - 1
        if cfg.adaptive:
            k = longest  # auto ranges over the whole block (one forward drafts all of it)
        elif cfg.num_speculative_tokens > longest:
            raise ValueError(f"num_speculative_tokens: {cfg.num_speculative_tokens} > {longest}, the most this "
                             f"DFlash drafter proposes (block size {drafter.block_size} - 1)")
        else:
            k = cfg.num_speculative_tokens
        lm_head = ctx.lm_head.detach()
        if ids is not None:
            if int(ids.min()) < 0 or int(ids.max()) >= ctx.vocab_size:
                raise ValueError(f"draft_model: {directory}: candidate ids outside the target's vocabulary")
            lm_head = lm_head[ids].contiguous()  # [Vc, H] once, not a gather per step
        return cls(drafter, ctx.input_embeddings, lm_head, ctx.device, ctx.dtype, k, ids,
                   ctx.target_config.num_hidden_layers)

    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.drafter.config, self.dtype)

    def bind_kv(self, num_blocks: int, block_size: int) -> None:
        self.kv = KVPool.allocate(self.drafter.config, num_blocks, block_size, self.dtype, self.device)

    # -- context ---------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def on_hidden(self, requests: list[Request], chunks: list[HiddenChunk]) -> None:
        """Project every handed-over position's features into the pool (one batched projection per step)."""
        feats, positions, slots = [], [], []
        bs = self.kv.block_size
        for req, chunk in zip(requests, chunks):
            n = next(iter(chunk.states.values())).shape[0]
            valid = self._valid.get(req.request_id, 0)
            if valid == _BROKEN or chunk.start > valid:
                self._valid[req.request_id] = _BROKEN
                continue
            self._valid[req.request_id] = chunk.start + n
            pos = torch.arange(chunk.start, chunk.start + n)  # [n]: a tensor op per request, not a loop per token
            feats.append(torch.cat([chunk.states[i] for i in self.layers], dim=-1))  # [n, nH]
            positions.append(pos)
            slots.append(torch.tensor(req.block_ids)[pos // bs] * bs + pos % bs)
        if not feats:
            return
        kv = self.drafter.context_kv(torch.cat(feats).to(self.dtype), torch.cat(positions).to(self.device))
        index = torch.cat(slots).to(self.device)
        for layer, (k, v) in enumerate(kv):
            for store, rows in ((self.kv.key_store[layer], k), (self.kv.value_store[layer], v)):
                store.view(-1, *store.shape[2:]).index_copy_(0, index, rows.to(store.dtype))

    def _gather_context(self, requests: list[Request], lengths: torch.Tensor):
        """Each request's context K/V per layer [S, L, kv_heads, D] (L = the longest; past a row's length: the null
        block) and which keys are real [S, L]."""
        bs, longest = self.kv.block_size, int(lengths.max())
        width = -(-longest // bs)
        tables = torch.full((len(requests), width), self.kv.null_block, dtype=torch.long)
        for i, req in enumerate(requests):
            blocks = req.block_ids[:width]
            tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
        key_pos = torch.arange(longest)[None, :].expand(len(requests), longest)  # [S, L]
        real = key_pos < lengths[:, None]
        slots = tables.gather(1, key_pos // bs) * bs + key_pos % bs
        slots = torch.where(real, slots, torch.full_like(slots, self.kv.null_block * bs)).to(self.device)
        out = []
        for k_store, v_store in zip(self.kv.key_store, self.kv.value_store):
            shape = (len(requests), longest, *k_store.shape[2:])
            out.append(tuple(store.view(-1, *store.shape[2:]).index_select(0, slots.view(-1)).view(shape)
                             for store in (k_store, v_store)))
        return out, real.to(self.device), key_pos.to(self.device)

    # -- drafting ---------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def draft(self, requests: list[Request], width: int) -> torch.Tensor:
        """One block forward for `requests` (each with its context complete) -> [S, width] drafted target ids."""
        s, b = len(requests), self.block_size
        lengths = torch.tensor([len(r.token_ids) - 1 for r in requests])  # context = positions before the last token
        tokens = torch.full((s, b), self.drafter.mask_token_id, dtype=torch.long)
        tokens[:, 0] = torch.tensor([r.token_ids[-1] for r in requests])
        x = self.embed(tokens.to(self.device)).to(self.dtype)  # [S, B, H]
        q_pos = (lengths[:, None] + torch.arange(b)[None, :]).to(self.device)  # [S, B]
        ctx_kv, real, key_pos = self._gather_context(requests, lengths)
        ctx_visible = real[:, None, :].expand(s, b, real.shape[1])
        same_block = torch.ones(s, b, b, dtype=torch.bool, device=self.device)
        masks = block_masks(self.drafter, ctx_visible, q_pos, torch.cat([key_pos, q_pos], dim=1), same_block)
        hidden = self.drafter(x, q_pos, ctx_kv, masks)  # [S, B, H]
        rows = hidden[:, 1: 1 + width].reshape(s * width, -1)  # 2-D: a 3-D matmul would copy the head per row
        top = torch.nn.functional.linear(rows, self.lm_head).argmax(dim=-1).view(s, width)  # of [S * width, V]
        return top if self.vocab_ids is None else self.vocab_ids[top]

    def propose(self, requests: list[Request], ks: list[int], default_generator: torch.Generator) -> Proposal:
        width = self.num_speculative_tokens
        ids = torch.full((len(requests), width), -1, dtype=torch.long, device=self.device)
        counts = [0] * len(requests)
        live = [i for i, r in enumerate(requests) if self._valid.get(r.request_id, 0) == len(r.token_ids) - 1 > 0]
        if live:
            caps = [min(ks[i], width) for i in live]
            used = max(caps)
            drafted = self.draft([requests[i] for i in live], used)  # [L, used]
            keep = torch.arange(used, device=self.device)[None, :] < torch.tensor(caps, device=self.device)[:, None]
            ids[torch.tensor(live, device=self.device), :used] = torch.where(keep, drafted,
                                                                            torch.full_like(drafted, -1))
            for i, cap in zip(live, caps):
                counts[i] = cap
        return Proposal(ids, counts)

    def on_verified(self, requests: list[Request], rows: list[VerifiedRow]) -> None:
        pass  # the accepted positions' context came through on_hidden; rejected ones never enter the pool

    def on_preempt(self, request: Request) -> None:
        self._valid.pop(request.request_id, None)  # its blocks are gone: the recomputed prefill refills them

    def on_free(self, request: Request) -> None:
        self._valid.pop(request.request_id, None)

    def kv_valid_tokens(self, request: Request) -> int:
        return max(0, self._valid.get(request.request_id, 0))  # a broken context (-1) holds nothing

    def on_cache_hit(self, request: Request, num_tokens: int) -> None:
        self._valid[request.request_id] = num_tokens  # the target's recompute of the rest fills in from here

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        self.kv.copy_blocks(src, dst)
