"""`specserve train medusa`: Medusa heads on the target's own answers (the `selfgen` set).

Stage 1 (Medusa-1): the target is frozen, so its last hidden states are computed once (teacher-forced over every
answer, bf16) and cached next to the checkpoints; training then samples positions, not sequences. Head k (from 0)
at position t is trained on token t + k + 2 with loss sum_k 0.8^k CE_k, through the target's frozen LM head.

Stage 2 (Medusa-2): the heads are warmed up first with the base frozen (stage 1 on live hidden states), then the
base and the heads train together, the base at a lower learning rate and with its own next-token loss kept in the
objective so it does not drift from what it was. It writes a NEW target directory (with the heads inside it):
losslessness is then with respect to that new target.

Both report per-head top-r accuracy on held-out prompts and pick the tree (engine/spec_decode/medusa/tree.py) from it
and from the target's verify cost measured here, written into the heads' config as `medusa_choices`.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

from specserve.engine.model.hidden import FINAL
from specserve.engine.model.loader import load_model, load_tokenizer
from specserve.engine.spec_decode.medusa.heads import MedusaHeads, load_heads
from specserve.engine.spec_decode.medusa.tree import choose_tree

from .loop import TrainConfig, compute_autocast, default_ckpt_dir, export_hf, run_loop, setup_runtime
from .selfdistill import load_set, split_by_prompt
from .teacher import teacher_forward, teacher_signals

DECAY = 0.8  # loss weight of head k: DECAY ** k (Medusa-1)
MAX_HEADS = 8  # labels cached per position
RANKS = 10  # top-r accuracies measured per head (the tree's search width)
IGNORE = -100


def load_target(path: str, dtype: torch.dtype):
    """The target for training: the engine's loader (GGUF dequantised), with ordinary attention."""
    target = load_model(path, dtype, torch.device("cpu"))
    target.set_attn_implementation("sdpa")  # the engine's loader installs its paged attention
    return target


def sequences(record: dict) -> tuple[torch.Tensor, int]:
    seq = torch.cat([record["prompt_ids"], record["output_ids"]]).long()
    return seq, len(record["prompt_ids"])


def future_labels(seq: torch.Tensor, n_prompt: int, width: int = MAX_HEADS) -> torch.Tensor:
    """[n - n_prompt, width] for positions t = n_prompt - 1 .. n - 2 (those whose next token is an answer
    token): label[:, k] = seq[t + k + 2], IGNORE past the end. Pure."""
    n = len(seq)
    t = torch.arange(n_prompt - 1, n - 1)
    idx = t[:, None] + torch.arange(width)[None, :] + 2
    padded = torch.cat([seq, torch.full((width + 2,), IGNORE, dtype=seq.dtype)])
    return padded[idx.clamp(max=len(padded) - 1)]


def cache_hidden(target, records: list[dict], target_path: str | None = None, cache_dir: Path | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forced final hidden states at the answer positions of every record -> (states [N, H] bf16,
    labels [N, MAX_HEADS] long). With target_path: through the one teacher path's stores (train/teacher.py); without
    (a target just trained, stage 2): computed afresh."""
    if target_path is None:
        signals = teacher_forward(target, records, [FINAL], 0, 4096, compute_autocast(), "medusa")
    else:
        signals = teacher_signals(target, target_path, records, [FINAL], 0, cache_dir or Path("."),
                                  compute_autocast(), "medusa")
    states, labels = [], []
    for r, sig in zip(records, signals):
        seq, n_prompt = sequences(r)
        states.append(sig["hidden"][n_prompt - 1: len(seq) - 1].to(torch.bfloat16))
        labels.append(future_labels(seq, n_prompt))
    return torch.cat(states), torch.cat(labels)


def head_loss(heads: MedusaHeads, lm_head: torch.Tensor | None, states: torch.Tensor, labels: torch.Tensor
              ) -> torch.Tensor:
    """sum_k DECAY^k * CE(head k, labels[:, k]) over the positions that have a label."""
    logits = heads.logits(states, lm_head)  # [K, N, V]
    total = states.new_zeros((), dtype=torch.float32)
    for k in range(heads.num_heads):
        target = labels[:, k]
        if (target != IGNORE).any():
            total = total + DECAY ** k * F.cross_entropy(logits[k].float(), target, ignore_index=IGNORE)
    return total


@torch.no_grad()
def head_accuracy(heads: MedusaHeads, lm_head: torch.Tensor | None, states: torch.Tensor, labels: torch.Tensor,
                  ranks: int = RANKS, chunk: int = 512) -> list[list[float]]:
    """accuracy[k][r] = P(head k's rank-r token is the right one), over positions with a label for head k."""
    hits = torch.zeros(heads.num_heads, ranks)
    counts = torch.zeros(heads.num_heads)
    for i in range(0, len(states), chunk):
        with compute_autocast():
            logits = heads.logits(states[i: i + chunk], lm_head)
        top = logits.float().topk(ranks, dim=-1).indices  # [K, n, R]
        lab = labels[i: i + chunk, : heads.num_heads].t()  # [K, n]
        valid = lab != IGNORE
        hits += ((top == lab[..., None]) & valid[..., None]).sum(1).float()
        counts += valid.sum(1).float()
    return (hits / counts.clamp_min(1)[:, None]).tolist()


def lm_head_weight(target) -> torch.Tensor:
    return target.get_output_embeddings().weight


@torch.no_grad()
def verify_costs(target, rows: tuple[int, ...] = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64), context: int = 256,
                 repeats: int = 5) -> dict[int, float]:
    """Seconds of one target forward of `rows` query tokens after a `context`-token cache (median of repeats),
    in the dtype the target was loaded in: what a verify step costs against plain decoding's 1 row."""
    from transformers import DynamicCache

    ids = torch.randint(0, target.config.vocab_size, (1, context + max(rows)))
    cache = DynamicCache()
    target(input_ids=ids[:, :context], past_key_values=cache, use_cache=True)
    out = {}
    for n in rows:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            target(input_ids=ids[:, context: context + n], past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - t0)
            cache.crop(-n)
        out[n] = sorted(times)[len(times) // 2]
    return out


def interpolate(costs: dict[int, float]):
    xs = sorted(costs)

    def cost(n: int) -> float:
        if n <= xs[0]:
            return costs[xs[0]]
        for a, b in zip(xs, xs[1:]):
            if n <= b:
                return costs[a] + (costs[b] - costs[a]) * (n - a) / (b - a)
        return costs[xs[-1]] * n / xs[-1]
    return cost


def pick_tree(accuracy: list[list[float]], target, max_nodes: int = 64) -> tuple[list[list[int]], dict]:
    costs = verify_costs(target)
    paths, info = choose_tree(accuracy, interpolate(costs), max_nodes)
    info["verify_seconds_by_rows"] = {str(n): round(s, 5) for n, s in costs.items()}
    return [list(p) for p in paths], info


def _split(records: list[dict]) -> tuple[list[dict], list[dict]]:
    train, held = split_by_prompt(records, 10)  # every tenth prompt
    return train, held or train[: max(1, len(train) // 10)]


def train_stage1(target_path: str, data: str | Path | list[dict], out: str | Path, cfg: TrainConfig,
                 num_heads: int = 4, num_layers: int = 1, max_len: int = 1024, choose: bool = True,
                 init_heads: str | None = None) -> dict:
    """Medusa-1 on a frozen target; exports the heads (our shared-LM-head format) to `out`. `init_heads` continues
    from exported heads."""
    setup_runtime(cfg)
    target = load_target(target_path, torch.bfloat16).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    ckpt_dir = Path(cfg.ckpt_dir) if cfg.ckpt_dir else default_ckpt_dir("medusa", out)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    records = data if isinstance(data, list) else load_set(data, max_len, target, target_path, ckpt_dir)
    train_recs, held_recs = _split(records)
    states, labels = cache_hidden(target, train_recs, target_path, ckpt_dir)
    held_states, held_labels = cache_hidden(target, held_recs, target_path, ckpt_dir)
    lm_head = lm_head_weight(target)
    hidden, vocab = states.shape[1], lm_head.shape[0]
    heads = load_heads(init_heads, hidden, vocab)[0].float().train() if init_heads else MedusaHeads(
        num_heads, num_layers, hidden)
    before = head_accuracy(heads, lm_head, held_states, held_labels)

    def batch(step: int):
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        idx = torch.randint(0, len(states), (cfg.batch_size,), generator=g)
        return _Positions(states[idx], labels[idx])

    summary = run_loop(heads, lambda b: head_loss(heads, lm_head, b.states, b.labels), batch,
                       [_Positions(held_states[: cfg.batch_size], held_labels[: cfg.batch_size])], cfg, ckpt_dir,
                       "medusa-1")
    heads.eval()
    accuracy = head_accuracy(heads, lm_head, held_states, held_labels)
    extra = {"stage": 1, "base_model": str(target_path), "train_positions": len(states),
             "heldout_positions": len(held_states), "num_answers": len(records)}
    info = {}
    if choose:
        choices, info = pick_tree(accuracy, target)
        extra["medusa_choices"] = choices
    heads.save(out, extra)
    report = {**{k: v for k, v in summary.items() if k != "config"}, **extra, "vocab_size": vocab,
              "top1_accuracy_untrained": [round(a[0], 4) for a in before], "init": init_heads or "random",
              "top1_accuracy": [round(a[0], 4) for a in accuracy],
              "accuracy_by_rank": [[round(x, 4) for x in a] for a in accuracy], "tree": info,
              "config": asdict(cfg)}
    (Path(out) / "train_summary.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"[medusa-1] per-head top-1 held-out: {report['top1_accuracy']} (untrained "
          f"{report['top1_accuracy_untrained']}); tree: {info.get('nodes')} nodes", flush=True)
    return report


class _Positions:
    def __init__(self, states: torch.Tensor, labels: torch.Tensor):
        self.states, self.labels = states, labels
        self.num_tokens = len(states)


class _Joint(torch.nn.Module):
    """Stage 2: the base and the heads as one module (so one optimizer and one checkpoint hold both)."""

    def __init__(self, target, heads: MedusaHeads):
        super().__init__()
        self.target, self.heads = target, heads

    def loss(self, batch, lm_weight: float) -> torch.Tensor:
        out = self.target.get_decoder()(input_ids=batch.ids, attention_mask=batch.mask).last_hidden_state
        rows = batch.rows  # [N] flat indices of the answer positions
        states = out.reshape(-1, out.shape[-1])[rows]
        lm_head = lm_head_weight(self.target)
        lm_logits = states @ lm_head.t()
        lm = F.cross_entropy(lm_logits.float(), batch.next_ids)  # the base's own next-token loss
        return lm_weight * lm + head_loss(self.heads, lm_head, states, batch.labels)


class _Sequences:
    def __init__(self, records: list[dict]):
        seqs = [sequences(r) for r in records]
        longest = max(len(s) for s, _ in seqs)
        self.ids = torch.zeros(len(seqs), longest, dtype=torch.long)
        self.mask = torch.zeros(len(seqs), longest, dtype=torch.long)
        rows, nxt, labels = [], [], []
        for b, (s, n_prompt) in enumerate(seqs):
            self.ids[b, : len(s)], self.mask[b, : len(s)] = s, 1
            rows.append(torch.arange(n_prompt - 1, len(s) - 1) + b * longest)
            nxt.append(s[n_prompt:])
            labels.append(future_labels(s, n_prompt))
        self.rows, self.next_ids, self.labels = torch.cat(rows), torch.cat(nxt), torch.cat(labels)
        self.num_tokens = int(self.mask.sum())


def train_stage2(target_path: str, data: str | Path | list[dict], out: str | Path, cfg: TrainConfig,
                 num_heads: int = 4, num_layers: int = 1, init_heads: str | None = None, warmup_steps: int = 50,
                 base_lr_scale: float = 0.1, lm_weight: float = 1.0, max_len: int = 1024, choose: bool = True
                 ) -> dict:
    """Medusa-2: heads warm-up (base frozen, `warmup_steps` steps, unless `init_heads` gives stage-1 heads), then
    joint training (base lr = lr * base_lr_scale). Writes a new target directory `out` with the heads in it."""
    setup_runtime(cfg)
    target = load_target(target_path, torch.float32)
    tokenizer = load_tokenizer(target_path)
    ckpt_root = Path(cfg.ckpt_dir) if cfg.ckpt_dir else default_ckpt_dir("medusa2", out)
    records = data if isinstance(data, list) else load_set(data, max_len, target, target_path, ckpt_root)
    train_recs, held_recs = _split(records)
    hidden, vocab = target.config.hidden_size, target.config.vocab_size
    heads = load_heads(init_heads, hidden, vocab)[0] if init_heads else MedusaHeads(num_heads, num_layers, hidden)
    joint = _Joint(target, heads)

    def batch(step: int):
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        pick = torch.randint(0, len(train_recs), (cfg.batch_size,), generator=g).tolist()
        return _Sequences([train_recs[i] for i in pick])

    held = [_Sequences(held_recs[i: i + cfg.batch_size]) for i in range(0, min(len(held_recs), 4 * cfg.batch_size),
                                                                          cfg.batch_size)]
    phases = {}
    if not init_heads and warmup_steps > 0:  # phase 1: heads only
        for p in target.parameters():
            p.requires_grad_(False)
        warm = TrainConfig(**{**asdict(cfg), "steps": warmup_steps, "max_minutes": None})
        phases["warmup"] = run_loop(joint, lambda b: joint.loss(b, 0.0), batch, held, warm, ckpt_root / "warmup",
                                    "medusa-2 warmup")
    for p in target.parameters():  # phase 2: joint, the base at a lower learning rate
        p.requires_grad_(True)
    target.get_output_embeddings().weight.requires_grad_(False)  # the heads share it: keep it (and the tie) fixed
    phases["joint"] = run_loop(joint, lambda b: joint.loss(b, lm_weight), batch, held, cfg, ckpt_root / "joint",
                               "medusa-2 joint", lr_scales={"target.": base_lr_scale})
    joint.eval()
    summary = {"stage": 2, "base_model": str(target_path), "base_lr_scale": base_lr_scale, "lm_weight": lm_weight,
               "phases": {k: {kk: vv for kk, vv in v.items() if kk != "config"} for k, v in phases.items()}}
    export_hf(target, tokenizer, out, summary)  # a new target: bf16 weights, tokenizer, template
    target = load_target(str(out), torch.bfloat16).eval()
    pos = _Positions(*cache_hidden(target, held_recs))
    accuracy = head_accuracy(heads, lm_head_weight(target), pos.states, pos.labels)
    extra = {"stage": 2, "base_model": str(out)}
    if choose:
        choices, summary["tree"] = pick_tree(accuracy, target)
        extra["medusa_choices"] = choices
    heads.save(out, extra)  # next to the new target's own config: "heads found in the model directory"
    summary["top1_accuracy"] = [round(a[0], 4) for a in accuracy]
    (Path(out) / "train_summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")
    return summary
