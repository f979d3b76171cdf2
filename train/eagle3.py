"""`specserve train eagle3`: an EAGLE-3 drafter for a frozen target, trained with training-time test.

Data: the kept corpus (train/answers.py) run through the target teacher-forced (train/teacher.py): the hidden
states of the three layers the drafter reads and the target's top-k next-token log-probs at every position.
Training-time test: the drafter is unrolled `ttt_steps` times; at step k the row that began at position t reads the
drafter's own output of step k - 1 as its hidden input (tokens stay the true ones, as in the EAGLE authors',
SpecForge's and speculators' trainers), sits at position t + k, attends to the real pairs up to t and to its own
chain, and is scored against the target's distribution at t + k (soft cross-entropy over the draft vocabulary;
rows whose target argmax lies outside it are left out), weighted 0.8^k. The draft vocabulary is the `draft_vocab`
target ids the target most often predicts on the training answers.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specserve.engine.model.hidden import final_norm
from specserve.engine.spec_decode.eagle3.model import (
    Eagle3Drafter,
    Eagle3Format,
    default_layer_ids,
    load_drafter,
    new_config,
    save_drafter,
)

from .loop import TrainConfig, compute_autocast, default_ckpt_dir, run_loop, setup_runtime
from .medusa import lm_head_weight, load_target
from .selfdistill import split_by_prompt
from .teacher import load_records, teacher_signals

DECAY = 0.8  # the weight of TTT step k is DECAY ** k


def draft_vocabulary(teacher: list[dict], records: list[dict], size: int, vocab: int) -> torch.Tensor:
    """The `size` target ids most often the target's argmax at answer positions, sorted (d2t stays monotone)."""
    counts = torch.zeros(vocab)
    for t, r in zip(teacher, records):
        n_prompt = len(r["prompt_ids"])
        counts.index_add_(0, t["top_ids"][n_prompt - 1: -1, 0].long(), torch.ones(len(r["output_ids"])))
    size = min(size, vocab)
    return counts.argsort(descending=True)[:size].sort().values


def build_drafter(target, layer_ids: list[int], draft_ids: torch.Tensor) -> Eagle3Drafter:
    """The target's width; lm_head rows and final norm copied from the target's (a head start for the projection
    to tokens); the rest freshly initialised."""
    cfg = new_config(target.config, len(draft_ids))
    drafter = Eagle3Drafter(cfg, Eagle3Format(list(layer_ids)), target.config.hidden_size, own_embeddings=False)
    with torch.no_grad():
        drafter.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
        drafter.lm_head.weight.copy_(lm_head_weight(target)[draft_ids].float())
        drafter.norm.weight.copy_(final_norm(target).weight.float())
    return drafter


@dataclass
class TTTBatch:
    tokens: torch.Tensor  # [B, L] target ids (padded with 0)
    features: torch.Tensor  # [B, L, 3H] the target's hidden states at the drafter's layers
    labels: torch.Tensor  # [B, L, k] draft ids of the target's top-k next tokens (-1: outside the draft vocabulary)
    label_probs: torch.Tensor  # [B, L, k] their probabilities, renormalised over the draft vocabulary
    scored: torch.Tensor  # [B, L] bool: an answer position whose target argmax is in the draft vocabulary
    lengths: torch.Tensor  # [B]
    num_tokens: int


def make_batch(items: list[tuple[dict, dict]], t2d: torch.Tensor) -> TTTBatch:
    """(record, teacher output) pairs -> one padded batch."""
    longest = max(len(t["hidden"]) for _, t in items)
    b, k = len(items), items[0][1]["top_ids"].shape[1]
    tokens = torch.zeros(b, longest, dtype=torch.long)
    feats = torch.zeros(b, longest, items[0][1]["hidden"].shape[1], dtype=torch.bfloat16)
    labels = torch.full((b, longest, k), -1, dtype=torch.long)
    probs = torch.zeros(b, longest, k)
    scored = torch.zeros(b, longest, dtype=torch.bool)
    for i, (r, t) in enumerate(items):
        n, n_prompt = len(t["hidden"]), len(r["prompt_ids"])
        tokens[i, :n] = torch.cat([r["prompt_ids"], r["output_ids"]]).long()
        feats[i, :n] = t["hidden"]
        draft = t2d[t["top_ids"].long()]  # [n, k]
        labels[i, :n] = draft
        p = t["top_logprobs"].float().exp() * (draft >= 0)
        probs[i, :n] = p / p.sum(-1, keepdim=True).clamp_min(1e-9)
        scored[i, n_prompt - 1: n - 1] = draft[n_prompt - 1: n - 1, 0] >= 0  # positions predicting answer tokens
    lengths = torch.tensor([len(t["hidden"]) for _, t in items])
    return TTTBatch(tokens, feats, labels, probs, scored, lengths, int(scored.sum()))


def unroll(drafter: Eagle3Drafter, embed, batch: TTTBatch, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Training-time test. Row r starts at position t = r + 1 with (g_r, token r + 1). -> per step k: (draft
    logits [B, R, Vd] of the rows scored at that step, the mask [B, R] of those rows: position t + k scored)."""
    b, length = batch.tokens.shape
    rows = length - 1
    r = torch.arange(rows)
    hidden = drafter.fc(batch.features[:, :rows].to(drafter.fc.weight.dtype))  # [B, R, H]
    keys, values, out = [], [], []
    causal = (r[None, :] <= r[:, None])  # [R, R] step 0: the real pairs up to the row's own
    for k in range(steps):
        pos = r + 1 + k  # [R]
        in_seq = pos[None, :] < batch.lengths[:, None]  # [B, R] the token at pos exists
        tok = batch.tokens.gather(1, pos.clamp(max=length - 1)[None, :].expand(b, rows))
        emb = embed(tok).to(hidden.dtype)
        q, key, value, residual = drafter.kv_and_query(emb, hidden, pos[None, :].expand(b, rows))
        keys.append(key)
        values.append(value)
        blocks = [causal.expand(b, rows, rows)] + [torch.eye(rows, dtype=torch.bool).expand(b, rows, rows)] * k
        mask = torch.cat(blocks, dim=-1) & torch.cat([in_seq] * (k + 1), dim=-1)[:, None, :]
        mask |= torch.cat([torch.zeros(rows, rows * k, dtype=torch.bool), torch.eye(rows, dtype=torch.bool)],
                          dim=-1)[None]  # a padded row still sees itself
        hidden = drafter.attend_and_finish(q, torch.cat(keys, dim=1), torch.cat(values, dim=1), residual, mask)
        scored = batch.scored.gather(1, pos.clamp(max=length - 1)[None, :].expand(b, rows)) & in_seq
        out.append((hidden, scored))
    return out


def ttt_loss(drafter: Eagle3Drafter, embed, steps: int):
    def loss_fn(batch: TTTBatch) -> torch.Tensor:
        total = 0.0
        b, length = batch.tokens.shape
        for k, (hidden, scored) in enumerate(unroll(drafter, embed, batch, steps)):
            if not scored.any():
                continue
            pos = torch.arange(length - 1) + 1 + k
            rows = scored.nonzero(as_tuple=True)
            logp = F.log_softmax(drafter.logits(hidden[rows]).float(), dim=-1)  # [N, Vd]
            labels = batch.labels[rows[0], pos[rows[1]].clamp(max=length - 1)]  # [N, k]
            probs = batch.label_probs[rows[0], pos[rows[1]].clamp(max=length - 1)]
            picked = logp.gather(-1, labels.clamp_min(0)) * (labels >= 0)
            total = total + DECAY ** k * -(probs * picked).sum(-1).mean()
        return total
    return loss_fn


@torch.no_grad()
def heldout_report(drafter: Eagle3Drafter, embed, batches: list[TTTBatch], steps: int) -> dict:
    """Per step, how often the drafter's argmax is the target's (rows scored at that step); and, on greedy answers
    (where the true tokens are the target's argmax), the mean accepted length of a greedy k-chain, tau."""
    hits, seen = [0] * steps, [0] * steps
    accepted, chains = 0.0, 0
    for batch in batches:
        b, length = batch.tokens.shape
        runs = torch.ones(b, length - 1, dtype=torch.bool)
        for k, (hidden, scored) in enumerate(unroll(drafter, embed, batch, steps)):
            pos = (torch.arange(length - 1) + 1 + k).clamp(max=length - 1)
            top = drafter.logits(hidden).argmax(-1)  # [B, R] draft ids
            match = top == batch.labels[:, :, 0].gather(1, pos[None, :].expand(b, -1))
            hits[k] += int((match & scored).sum())
            seen[k] += int(scored.sum())
            runs &= match | ~scored
            if k == 0:
                start = scored.clone()
            accepted += float((runs & scored & start).sum())
        chains += int(start.sum())
    return {"top1_by_step": [round(h / max(s, 1), 4) for h, s in zip(hits, seen)],
            "tau": round(1 + accepted / max(chains, 1), 3), "positions": seen[0]}


def _batches(items: list[tuple[dict, dict]], t2d: torch.Tensor, batch_tokens: int) -> list[TTTBatch]:
    order = sorted(range(len(items)), key=lambda i: len(items[i][1]["hidden"]))
    out, group = [], []
    for i in order:
        if group and (len(group) + 1) * len(items[i][1]["hidden"]) > batch_tokens:
            out.append(make_batch([items[j] for j in group], t2d))
            group = []
        group.append(i)
    if group:
        out.append(make_batch([items[j] for j in group], t2d))
    return out


class EpochSampler:
    """Batches in a fresh seeded order each epoch (every token seen once per epoch), counting the training tokens
    served; with `curve_every`, the held-out report each time that many more tokens have been seen: acceptance
    against data seen, which in the first epoch is acceptance against corpus size."""

    def __init__(self, batches: list[TTTBatch], seed: int, report=None, curve_every: int = 0):
        self.batches, self.rng, self.report, self.curve_every = batches, random.Random(seed), report, curve_every
        self.order: list[int] = []
        self.epoch, self.tokens = 0, 0
        self.curve: list[dict] = []

    def __call__(self, step: int) -> TTTBatch:
        if not self.order:
            self.order = list(range(len(self.batches)))
            self.rng.shuffle(self.order)
            self.epoch += 1
        batch = self.batches[self.order.pop()]
        if self.curve_every and self.report and self.tokens // self.curve_every < \
                (self.tokens + batch.num_tokens) // self.curve_every:
            self.curve.append({"train_tokens_seen": self.tokens, "epoch": self.epoch, **self.report()})
            print(f"[eagle3] curve {self.curve[-1]}", flush=True)
        self.tokens += batch.num_tokens
        return batch


def train_eagle3(target_path: str, data: str | Path, out: str | Path, cfg: TrainConfig, ttt_steps: int = 4,
                 draft_vocab: int = 8192, layer_ids: list[int] | None = None, max_len: int = 512,
                 top_k: int = 20, batch_tokens: int = 2048, max_sequences: int | None = None,
                 init_drafter: str | None = None, curve_every: int = 0) -> dict:
    """Trains and exports (speculators format) an EAGLE-3 drafter; writes train_summary.json with the held-out
    report before and after training. `init_drafter` continues from an exported drafter (its layers and draft
    vocabulary)."""
    if ttt_steps < 1:
        raise ValueError(f"ttt_steps: must be >= 1, got {ttt_steps}")
    ckpt_dir = Path(cfg.ckpt_dir) if cfg.ckpt_dir else default_ckpt_dir("eagle3", out)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    cfg.ckpt_dir = str(ckpt_dir)
    setup_runtime(cfg)
    target = load_target(target_path, torch.bfloat16).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    prior = load_drafter(init_drafter, target.config, torch.float32, torch.device("cpu")) if init_drafter else None
    layer_ids = prior.format.layer_ids if prior is not None else layer_ids or default_layer_ids(
        target.config.num_hidden_layers)
    records = [r for r in load_records(data, max_len) if len(r["output_ids"]) > 1][:max_sequences]
    teacher = teacher_signals(target, target_path, records, [i - 1 for i in layer_ids], top_k, ckpt_dir,
                              compute_autocast(), "eagle3 teacher")
    train_recs, held_recs = split_by_prompt(records, 16)
    by_index = {r["index"]: t for r, t in zip(records, teacher)}
    del teacher
    train_items = [(r, by_index[r["index"]]) for r in train_recs]
    held_items = [(r, by_index[r["index"]]) for r in held_recs]
    del by_index
    vocab = target.config.vocab_size
    if prior is not None:
        drafter, ids = prior.train(), prior.draft_to_target.long().cpu()
    else:
        ids = draft_vocabulary([t for _, t in train_items], [r for r, _ in train_items], draft_vocab or vocab, vocab)
        drafter = build_drafter(target, layer_ids, ids)
    t2d = torch.full((vocab,), -1, dtype=torch.long)
    t2d[ids] = torch.arange(len(ids))
    embed = target.get_input_embeddings()
    held = _batches(held_items, t2d, batch_tokens)[:24]
    held_greedy = _batches([it for it in held_items if float(it[0].get("temperature", 0.0)) == 0.0], t2d,
                           batch_tokens)[:24]
    before = heldout_report(drafter, embed, held, ttt_steps)
    train_batches = _batches(train_items, t2d, batch_tokens)
    train_answer_tokens = sum(len(r["output_ids"]) for r, _ in train_items)
    del train_items

    def curve_report() -> dict:
        drafter.eval()
        try:
            return heldout_report(drafter, embed, held[:8], ttt_steps)
        finally:
            drafter.train()

    sampler = EpochSampler(train_batches, cfg.seed, curve_report, curve_every)
    summary = run_loop(drafter, ttt_loss(drafter, embed, ttt_steps), sampler, held[:4], cfg, ckpt_dir, "eagle3")
    drafter.eval()
    after = heldout_report(drafter, embed, held, ttt_steps)
    answer_positions = sum(len(r["output_ids"]) for r, _ in held_items)
    coverage = sum(int(b.scored.sum()) for b in _batches(held_items, t2d, batch_tokens)) / max(1, answer_positions)
    greedy = heldout_report(drafter, embed, held_greedy, ttt_steps) if held_greedy else None
    save_drafter(drafter.to(torch.bfloat16), out, str(target_path))
    summary |= {"target": str(target_path), "layer_ids": layer_ids, "ttt_steps": ttt_steps,
                "init": init_drafter or "fresh (lm_head rows and final norm from the target)",
                "draft_vocab": len(ids), "train_sequences": len(train_recs), "heldout_sequences": len(held_items),
                "train_answer_tokens": train_answer_tokens, "epochs_started": sampler.epoch,
                "heldout_before": before, "heldout_trained": after, "heldout_greedy_trained": greedy,
                "heldout_answer_positions_in_draft_vocab": round(coverage, 4), "curve": sampler.curve}
    (Path(out) / "train_summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    return summary
