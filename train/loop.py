"""Shared training machinery for target and draft: packed batches, cosine LR, time budget,
resumable checkpoints (model + optimizer + step + RNG) and the bf16 Hugging Face export.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from specserve.engine.model.loader import resolve_dtype

from .threads import ThreadTuner


@dataclass
class TrainConfig:
    steps: int = 100_000           # upper bound; with max_minutes set the clock usually ends the run
    seq_len: int = 512
    batch_size: int = 8
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    max_minutes: float | None = None
    threads: int | None = None
    auto_threads: bool = False     # probe `threads` vs 1 thread and keep the faster (shared CPUs)
    ckpt_dir: str = ""
    ckpt_every_minutes: float = 5.0
    log_every: int = 10
    eval_batches: int = 8


def cache_base() -> Path:
    """Where training keeps what it can recompute ($SPECSERVE_CACHE, default ~/.cache/specserve)."""
    return Path(os.environ.get("SPECSERVE_CACHE", Path.home() / ".cache" / "specserve"))


def default_ckpt_dir(kind: str, out: str | Path) -> Path:
    # Outside git on purpose: checkpoints carry fp32 weights and optimizer moments (~4x the export).
    return cache_base() / "ckpt" / f"{kind}-{Path(out).resolve().name}"


def train_dtype() -> torch.dtype:
    """What training computes in: the engine's `auto` on CPU (bf16 where native, else fp32)."""
    return resolve_dtype("auto", torch.device("cpu"))


def compute_autocast():
    """bf16 autocast where the CPU computes bf16 natively; plain fp32 elsewhere (emulated bf16 is slower)."""
    if train_dtype() == torch.bfloat16:
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def setup_runtime(cfg: TrainConfig) -> None:
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)


def pack_tokens(tokenizer, texts, eos_id: int) -> torch.Tensor:
    """All documents tokenised and joined by EOS into one flat int32 stream."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int32)


def cached_tokens(path: Path, build: Callable[[], torch.Tensor]) -> torch.Tensor:
    if path.exists():
        return torch.load(path)
    tokens = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(tokens, path)
    return tokens


def batch_at(tokens: torch.Tensor, step: int, cfg: TrainConfig) -> torch.Tensor:
    """Batch for `step`: non-overlapping windows in a per-epoch permutation seeded by (seed, epoch).

    A pure function of the step, so a resumed run sees exactly the batches it would have seen.
    """
    num_windows = len(tokens) // cfg.seq_len
    if num_windows < 1:
        raise ValueError(f"seq_len: corpus has {len(tokens)} tokens, fewer than seq_len={cfg.seq_len}")
    start = step * cfg.batch_size
    rows = []
    for i in range(start, start + cfg.batch_size):
        epoch, pos = divmod(i, num_windows)
        perm = torch.randperm(num_windows, generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch))
        w = int(perm[pos])
        rows.append(tokens[w * cfg.seq_len:(w + 1) * cfg.seq_len])
    return torch.stack(rows).long()  # [B, T]


def eval_batches(tokens: torch.Tensor, cfg: TrainConfig) -> list[torch.Tensor]:
    n = min(cfg.eval_batches * cfg.batch_size, len(tokens) // cfg.seq_len)
    if n == 0:
        return []
    windows = tokens[: n * cfg.seq_len].view(n, cfg.seq_len).long()
    return list(windows.split(cfg.batch_size))


def lr_at(step: int, elapsed_s: float, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine to min_lr over whichever runs out first: steps or the time budget."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    if cfg.max_minutes:
        # Time-based decay: on a fixed wall-clock budget the LR reaches its floor when the clock does.
        progress = max(progress, elapsed_s / (cfg.max_minutes * 60))
    progress = min(1.0, progress)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig, lr_scales: dict[str, float] | None = None
                   ) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; `lr_scales` maps a parameter-name prefix to a multiple of the
    schedule's learning rate (kept in each group's "lr_scale")."""
    lr_scales = lr_scales or {}

    def scale(name: str) -> float:
        return next((v for prefix, v in lr_scales.items() if name.startswith(prefix)), 1.0)
    groups: dict[tuple[bool, float], list] = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            groups.setdefault((p.dim() >= 2, scale(n)), []).append(p)
    params = [{"params": ps, "weight_decay": cfg.weight_decay if decay else 0.0, "lr_scale": s}
              for (decay, s), ps in groups.items()]
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def save_checkpoint(path: Path, model, optimizer, state: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(), **state}, tmp)
    os.replace(tmp, path)  # atomic: a kill mid-save never leaves a torn checkpoint


def load_checkpoint(path: Path, model, optimizer) -> dict:
    ckpt = torch.load(path, weights_only=False)
    model.load_state_dict(ckpt.pop("model"))
    optimizer.load_state_dict(ckpt.pop("optimizer"))
    torch.set_rng_state(ckpt.pop("torch_rng"))
    random.setstate(ckpt.pop("python_rng"))
    return ckpt


def run_loop(model, loss_fn: Callable, tokens: torch.Tensor | Callable[[int], object],
             heldout: list, cfg: TrainConfig, ckpt_dir: Path, desc: str,
             lr_scales: dict[str, float] | None = None) -> dict:
    """Train until `steps` or `max_minutes`; checkpoint on a timer, on SIGTERM/SIGINT and at the end.

    `tokens` is a packed token stream (batches are `batch_at` windows) or a function step -> batch whose
    result has `num_tokens`; `loss_fn(batch)` returns a scalar loss. Returns a summary dict.
    """
    optimizer = make_optimizer(model, cfg, lr_scales)
    ckpt_path = ckpt_dir / "latest.pt"
    state = {"step": 0, "elapsed_s": 0.0, "tokens_seen": 0, "history": []}
    if ckpt_path.exists():
        state.update(load_checkpoint(ckpt_path, model, optimizer))
        print(f"[{desc}] resumed from {ckpt_path} at step {state['step']}", flush=True)
    stop = {"signal": None}  # set by the handler; local so nothing module-level mutates

    def on_signal(signum, _frame):
        stop["signal"] = signum
    # Python only lets the main thread install handlers; elsewhere (a server worker) just run.
    in_main = threading.current_thread() is threading.main_thread()
    signals = (signal.SIGTERM, signal.SIGINT) if in_main else ()
    old_handlers = {s: signal.signal(s, on_signal) for s in signals}

    budget_s = cfg.max_minutes * 60 if cfg.max_minutes else math.inf
    model.train()
    t_start = time.time() - state["elapsed_s"]
    t_ckpt = time.time()
    window_tokens, window_t0, loss_ema = 0, time.time(), None
    tuner = ThreadTuner(cfg.threads or torch.get_num_threads()) if cfg.auto_threads else None
    bar = tqdm(total=cfg.steps, initial=state["step"], desc=desc, disable=not sys.stderr.isatty())
    try:
        while state["step"] < cfg.steps and time.time() - t_start < budget_s and stop["signal"] is None:
            step = state["step"]
            lr = lr_at(step, time.time() - t_start, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr * group.get("lr_scale", 1.0)
            batch = tokens(step) if callable(tokens) else batch_at(tokens, step, cfg)
            batch_tokens = batch.numel() if isinstance(batch, torch.Tensor) else batch.num_tokens
            threads = tuner.before_step(step) if tuner else torch.get_num_threads()
            t_step = time.time()
            with compute_autocast():
                loss = loss_fn(batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], cfg.grad_clip)
            optimizer.step()
            if tuner:
                tuner.after_step(time.time() - t_step)
            state["step"] = step + 1
            state["tokens_seen"] += batch_tokens
            window_tokens += batch_tokens
            value = loss.detach().item()
            loss_ema = value if loss_ema is None else 0.95 * loss_ema + 0.05 * value
            state["history"].append((state["step"], round(value, 4)))
            tok_s = window_tokens / max(1e-9, time.time() - window_t0)
            bar.update(1)
            bar.set_postfix(loss=f"{loss_ema:.3f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:.0f}")
            if state["step"] % cfg.log_every == 0:
                print(f"[{desc}] step {state['step']} loss {value:.4f} ema {loss_ema:.4f} lr {lr:.2e} "
                      f"tok/s {tok_s:.0f} threads {threads} "
                      f"elapsed {(time.time() - t_start) / 60:.1f}m", flush=True)
                window_tokens, window_t0 = 0, time.time()
            if time.time() - t_ckpt > cfg.ckpt_every_minutes * 60:
                state["elapsed_s"] = time.time() - t_start
                save_checkpoint(ckpt_path, model, optimizer, state)
                t_ckpt = time.time()
    finally:
        bar.close()
        for s, h in old_handlers.items():
            signal.signal(s, h)
    state["elapsed_s"] = time.time() - t_start
    save_checkpoint(ckpt_path, model, optimizer, state)
    heldout_loss = evaluate(loss_fn, model, heldout)
    summary = {"steps": state["step"], "tokens_seen": state["tokens_seen"],
               "train_minutes": round(state["elapsed_s"] / 60, 2),
               "tokens_per_s": round(state["tokens_seen"] / max(1e-9, state["elapsed_s"]), 1),
               "final_train_loss_ema": None if loss_ema is None else round(loss_ema, 4),
               "first_train_loss": state["history"][0][1] if state["history"] else None,
               "last_train_loss": _mean_tail(state["history"], 10),
               "heldout_loss": heldout_loss, "stopped_by_signal": stop["signal"], "config": asdict(cfg)}
    print(f"[{desc}] done: {json.dumps({k: v for k, v in summary.items() if k != 'config'})}", flush=True)
    return summary


def _mean_tail(history: list, n: int) -> float | None:
    tail = [loss for _, loss in history[-n:]]
    return round(sum(tail) / len(tail), 4) if tail else None


@torch.no_grad()
def evaluate(loss_fn, model, batches: list[torch.Tensor]) -> float | None:
    if not batches:
        return None
    model.eval()
    with compute_autocast():
        losses = [float(loss_fn(b)) for b in batches]
    model.train()
    return round(sum(losses) / len(losses), 4)


def export_hf(model, tokenizer, out_dir: str | Path, summary: dict) -> None:
    """Standard HF directory: bf16 safetensors, config, generation_config (eos), tokenizer, template."""
    from transformers import GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16).eval()
    model.config.dtype = torch.bfloat16
    eos = tokenizer.eos_token_id
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
