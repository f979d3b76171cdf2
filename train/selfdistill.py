"""Distil a draft on the target's own answers (the `selfgen` set): soft cross-entropy against the target's top-k
next-token distribution at every answer position, optionally over a sub-vocabulary of the most frequent target
tokens (a `vocab_map.safetensors` next to the weights), and optionally initialised from target layers.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from specserve.engine.model.loader import load_model, load_tokenizer
from specserve.engine.model.vocab_map import VocabMap, load_vocab_map, save_vocab_map

from .distill import draft_config, project_embeddings
from .loop import TrainConfig, compute_autocast, default_ckpt_dir, export_hf, run_loop, setup_runtime
from .teacher import load_records, with_top_k


@dataclass
class SeqBatch:
    input_ids: torch.Tensor  # [B, T] draft ids
    target_ids: torch.Tensor  # [B, T, K] draft ids of the target's top-k next tokens (0 where unused)
    target_probs: torch.Tensor  # [B, T, K] their probabilities (0 at prompt/padding positions, outside the map)
    num_tokens: int


def load_set(directory: str | Path, max_len: int, target=None, target_path: str = "",
             cache_dir: Path | None = None) -> list[dict]:
    """The answers (train/teacher.py) with the target's top-k at every answer position: stored in an older selfgen
    set, computed teacher-forced by `target` for the kept corpus."""
    records = load_records(directory, max_len)
    if target is not None:
        records = with_top_k(records, target, target_path, cache_dir or Path(directory), autocast=compute_autocast())
    elif any("top_ids" not in r for r in records):
        raise ValueError(f"data: {directory} stores token ids only; the target's top-k needs the target")
    return records


def frequent_tokens(records: list[dict], size: int, always: list[int]) -> torch.Tensor:
    """The `size` target ids with the most expected occurrences as next token (sum of the target's top-k
    probabilities over all answer positions), plus `always` (end-of-turn ids)."""
    mass = torch.zeros(max(int(r["top_ids"].max()) for r in records) + 1)
    for r in records:
        mass.index_add_(0, r["top_ids"].flatten().long(), r["top_logprobs"].flatten().float().exp())
    order = [i for i in mass.argsort(descending=True).tolist() if i not in always]
    return torch.tensor(list(always) + order[: size - len(always)], dtype=torch.long)


def split_by_prompt(records: list[dict], every: int) -> tuple[list[dict], list[dict]]:
    """(train, held out): 1 prompt in `every` is held out by its index (both of its answers), so the split stays the
    same as the set grows between runs."""
    held = [r for r in records if r.get("prompt_index", r["index"]) % every == 0]
    return [r for r in records if r.get("prompt_index", r["index"]) % every], held


def make_batch(records: list[dict], vmap: VocabMap | None) -> SeqBatch:
    length = max(len(r["prompt_ids"]) + len(r["output_ids"]) for r in records)
    k = records[0]["top_ids"].shape[1]
    ids = torch.zeros(len(records), length, dtype=torch.long)
    tids = torch.zeros(len(records), length, k, dtype=torch.long)
    tprobs = torch.zeros(len(records), length, k)
    for b, r in enumerate(records):
        seq = torch.cat([r["prompt_ids"], r["output_ids"]]).long()
        n_prompt, n_out = len(r["prompt_ids"]), len(r["output_ids"])
        ids[b, : len(seq)] = seq
        # the logits at position n_prompt - 1 + j predict output token j
        tids[b, n_prompt - 1: n_prompt - 1 + n_out] = r["top_ids"].long()
        tprobs[b, n_prompt - 1: n_prompt - 1 + n_out] = r["top_logprobs"].float().exp()
    if vmap is not None:
        ids = vmap.t2d[ids]
        tids = vmap.t2d[tids]
        tprobs = torch.where(tids < vmap.d2t.numel(), tprobs, 0.0)  # the draft cannot propose these
    tprobs = tprobs / tprobs.sum(-1, keepdim=True).clamp_min(1e-9)  # renormalise the kept top-k
    return SeqBatch(ids, tids, tprobs, int((tprobs.sum(-1) > 0).sum()))


def soft_ce_loss(draft, vmap: VocabMap | None):
    def loss_fn(batch: SeqBatch) -> torch.Tensor:
        logits = draft(input_ids=batch.input_ids).logits.float()  # [B, T, Vd]
        if vmap is not None:
            logits[..., vmap.d2t.numel():] = float("-inf")  # the unknown id is never drafted
        logq = F.log_softmax(logits, dim=-1).gather(-1, batch.target_ids)  # [B, T, K]
        return -(batch.target_probs * logq.clamp_min(-1e4)).sum() / max(batch.num_tokens, 1)
    return loss_fn


@torch.no_grad()
def agreement(draft, batches: list[SeqBatch], vmap: VocabMap | None) -> float:
    """Teacher-forced fraction of answer positions where the draft's argmax is the target's top-1 (a top-1
    outside the sub-vocabulary counts as a miss: the draft cannot propose it)."""
    hit = total = 0
    with compute_autocast():
        for b in batches:
            logits = draft(input_ids=b.input_ids).logits.float()  # [B, T, Vd]
            pred = logits[..., : vmap.d2t.numel()].argmax(-1) if vmap is not None else logits.argmax(-1)
            valid = b.target_probs.sum(-1) > 0  # [B, T] answer positions
            hit += int(((pred == b.target_ids[..., 0]) & valid & (b.target_probs[..., 0] > 0)).sum())
            total += int(valid.sum())
    return round(hit / max(total, 1), 4)


def init_from_target(target, layers: list[int], d2t: torch.Tensor | None) -> LlamaForCausalLM:
    """A draft with the target's width made of some of its layers, its final norm, and its (tied) embedding
    restricted to the sub-vocabulary (+ one unknown row: the mean embedding)."""
    cfg = target.config.__class__.from_dict(target.config.to_dict())
    cfg.num_hidden_layers = len(layers)
    cfg.layer_types = None
    emb = target.get_input_embeddings().weight.detach().float()  # [V, H]
    if d2t is not None:
        emb = torch.cat([emb[d2t], emb.mean(0, keepdim=True)])
    cfg.vocab_size = emb.shape[0]
    cfg.tie_word_embeddings = True
    draft = LlamaForCausalLM(cfg)
    draft.set_attn_implementation("sdpa")  # the copied config may name the engine's paged attention
    draft.get_input_embeddings().weight.data.copy_(emb)
    for i, src in enumerate(layers):
        draft.model.layers[i].load_state_dict(target.model.layers[src].state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    return draft.float()


def train_selfdistill(target_path: str, data: str | Path, out: str | Path, cfg: TrainConfig, draft_vocab: int = 0,
                      init_layers: list[int] | None = None, model_kwargs: dict | None = None,
                      max_len: int = 512, freeze_embeddings: bool = False, init_draft: str | None = None) -> dict:
    ckpt_dir = Path(cfg.ckpt_dir) if cfg.ckpt_dir else default_ckpt_dir("selfdistill", out)
    cfg.ckpt_dir = str(ckpt_dir)
    setup_runtime(cfg)
    tokenizer = load_tokenizer(target_path)
    target = load_model(target_path, torch.float32, torch.device("cpu"))
    records = load_set(data, max_len, target, target_path, ckpt_dir)
    train, heldout = split_by_prompt(records, 30)
    vocab = target.config.vocab_size
    eos = target.generation_config.eos_token_id
    always = sorted({tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None})
    d2t = frequent_tokens(train, draft_vocab, always) if draft_vocab else None
    if init_draft:  # continue from an exported draft: its weights and its vocabulary map
        prior = load_vocab_map(init_draft, vocab, torch.device("cpu"))
        d2t = prior.d2t if prior is not None else None
    vmap = VocabMap.from_d2t(d2t, vocab) if d2t is not None else None
    torch.manual_seed(cfg.seed)
    if init_draft:
        draft = LlamaForCausalLM.from_pretrained(init_draft, dtype=torch.float32)
        draft.set_attn_implementation("sdpa")
        init = f"draft {init_draft}"
    elif init_layers:
        draft = init_from_target(target, init_layers, d2t)
        init = f"target layers {init_layers}"
    else:
        draft = LlamaForCausalLM(draft_config(target.config, **(model_kwargs or {})))
        if d2t is not None:
            draft.resize_token_embeddings(vmap.draft_vocab)
        init = "projected" if d2t is None and project_embeddings(target, draft) else "random"
    del target
    if freeze_embeddings:  # EAGLE-style: keep the target's (tied) embedding and LM head; train the body only
        draft.get_input_embeddings().weight.requires_grad_(False)
    n_params = sum(p.numel() for p in draft.parameters())
    coverage = None
    if vmap is not None:
        probe = make_batch(heldout[:64], None)
        kept = vmap.t2d[probe.target_ids[..., 0]] < vmap.d2t.numel()
        coverage = round(float(kept[probe.target_probs[..., 0] > 0].float().mean()), 4)
    print(f"[selfdistill] {len(train)} train / {len(heldout)} held-out answers, draft {n_params / 1e6:.2f}M params, "
          f"init {init}, vocabulary {'full' if vmap is None else vmap.d2t.numel()} "
          f"(held-out top-1 coverage {coverage})", flush=True)

    lengths = [len(r["prompt_ids"]) + len(r["output_ids"]) for r in train]
    per_epoch = len(train) // cfg.batch_size
    if per_epoch < 1:
        raise ValueError(f"batch_size: {cfg.batch_size} is more than the {len(train)} training answers")

    def batch_fn(step: int) -> SeqBatch:
        """A pure function of the step (a resumed run sees the same batches): per-epoch shuffle, then sorted by
        length inside groups of 16 batches, so a batch pads little."""
        epoch, b = divmod(step, per_epoch)
        order = list(range(len(train)))
        random.Random(cfg.seed * 1000 + epoch).shuffle(order)
        group = 16 * cfg.batch_size
        start = (b * cfg.batch_size) // group * group
        chunk = sorted(order[start:start + group], key=lambda i: lengths[i])
        offset = b * cfg.batch_size - start
        return make_batch([train[i] for i in chunk[offset:offset + cfg.batch_size]], vmap)

    held_batches = [make_batch(heldout[i:i + cfg.batch_size], vmap)
                    for i in range(0, min(len(heldout), cfg.eval_batches * cfg.batch_size), cfg.batch_size)]
    before = agreement(draft, held_batches, vmap)
    summary = run_loop(draft, soft_ce_loss(draft, vmap), batch_fn, held_batches, cfg, ckpt_dir, desc="selfdistill")
    draft.eval()
    summary.update(kind="selfdistill-draft", target=str(target_path), data=str(data), num_params=n_params, init=init,
                   draft_vocab=None if vmap is None else vmap.d2t.numel(), heldout_top1_coverage=coverage,
                   heldout_agreement_before=before, heldout_agreement=agreement(draft, held_batches, vmap),
                   num_train_answers=len(train), frozen_embeddings=freeze_embeddings)
    print(f"[selfdistill] held-out top-1 agreement {before} -> {summary['heldout_agreement']}", flush=True)
    export_hf(draft, tokenizer, out, summary)
    if d2t is not None:
        save_vocab_map(out, d2t)
    print(f"[selfdistill] exported to {out}", flush=True)
    return summary
