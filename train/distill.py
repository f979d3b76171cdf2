"""Distil a small draft from any Hugging Face causal-LM target (DistillSpec-style, white-box).

The target's next-token distributions are computed on the fly in bf16 under no_grad; the draft
minimises forward KL(target || draft) or total variation distance against them on corpus text.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from .corpus import load_corpus
from .loop import (
    TrainConfig,
    cached_tokens,
    compute_autocast,
    default_ckpt_dir,
    eval_batches,
    export_hf,
    pack_tokens,
    run_loop,
    setup_runtime,
    train_dtype,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")


def draft_config(target_config, num_layers: int = 1, hidden: int = 256, intermediate: int = 768,
                 heads: int = 4, kv_heads: int = 4) -> LlamaConfig:
    """Draft shares the target's vocabulary and special ids; only the body shrinks."""
    eos = target_config.eos_token_id
    return LlamaConfig(
        vocab_size=target_config.vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=getattr(target_config, "max_position_embeddings", 2048),
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=getattr(target_config, "bos_token_id", eos),
        eos_token_id=eos,
        pad_token_id=getattr(target_config, "pad_token_id", None),
        initializer_range=0.02,
    )


@torch.no_grad()
def project_embeddings(target, draft) -> bool:
    """Initialise the draft's tied embedding with the target's output embedding projected onto its
    top principal directions, keeping the geometry the target's logits rely on. False if sizes forbid."""
    src = target.get_output_embeddings() or target.get_input_embeddings()
    weight = src.weight.float()  # [V, H_target]
    dst = draft.get_input_embeddings().weight  # [V, H_draft]
    if weight.shape[0] != dst.shape[0] or weight.shape[1] < dst.shape[1]:
        return False
    _, _, v = torch.linalg.svd(weight - weight.mean(0), full_matrices=False)
    dst.copy_(weight @ v[: dst.shape[1]].T)
    return True


def distill_loss(target, draft, kind: str = "fkl"):
    """loss_fn(batch) for run_loop: per-position divergence between target and draft, averaged."""
    if kind not in ("fkl", "tvd"):
        raise ValueError(f"loss: expected 'fkl' or 'tvd', got {kind!r}")

    def loss_fn(batch: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            p_logits = target(input_ids=batch).logits  # [B, T, V_target]
        q_logits = draft(input_ids=batch).logits  # [B, T, V]
        vocab = q_logits.shape[-1]
        log_p = F.log_softmax(p_logits[..., :vocab].float(), dim=-1)
        log_q = F.log_softmax(q_logits.float(), dim=-1)
        if kind == "fkl":
            return F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1).mean()
        return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1).mean()
    return loss_fn


@torch.no_grad()
def greedy_agreement(target, draft, batches: list[torch.Tensor]) -> float | None:
    """Teacher-forced fraction of positions where draft argmax == target argmax (acceptance proxy)."""
    if not batches:
        return None
    agree = total = 0
    with compute_autocast():
        for batch in batches:
            t = target(input_ids=batch).logits.argmax(-1)  # [B, T]
            d = draft(input_ids=batch).logits.argmax(-1)
            agree += int((t == d).sum())
            total += t.numel()
    return round(agree / total, 4)


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src) / name).exists():
            shutil.copy2(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied


def train_draft(target_dir: str | Path, out: str | Path, cfg: TrainConfig, corpus: str | None = None,
                model_kwargs: dict | None = None, init: str = "project", loss: str = "fkl") -> dict:
    ckpt_dir = Path(cfg.ckpt_dir) if cfg.ckpt_dir else default_ckpt_dir("draft", out)
    cfg.ckpt_dir = str(ckpt_dir)
    setup_runtime(cfg)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=train_dtype()).eval()
    target.requires_grad_(False)
    eos = tokenizer.eos_token_id
    data = load_corpus(corpus)
    tokens = cached_tokens(ckpt_dir / "train_tokens.pt",
                           lambda: pack_tokens(tokenizer, data.iter_texts("train"), eos))
    heldout_tokens = cached_tokens(ckpt_dir / "heldout_tokens.pt",
                                   lambda: pack_tokens(tokenizer, data.iter_texts("heldout"), eos))

    torch.manual_seed(cfg.seed)
    draft = LlamaForCausalLM(draft_config(target.config, **(model_kwargs or {})))
    projected = init == "project" and project_embeddings(target, draft)
    n_draft = sum(p.numel() for p in draft.parameters())
    n_target = sum(p.numel() for p in target.parameters())
    print(f"[draft] target={target_dir} ({n_target / 1e6:.2f}M) draft params={n_draft / 1e6:.2f}M "
          f"layers={draft.config.num_hidden_layers} hidden={draft.config.hidden_size} "
          f"embedding_init={'projected' if projected else 'random'} train_tokens={len(tokens)}", flush=True)

    heldout = eval_batches(heldout_tokens, cfg)
    summary = run_loop(draft, distill_loss(target, draft, loss), tokens, heldout, cfg, ckpt_dir,
                       desc="draft")
    draft.eval()
    summary.update(kind="draft", loss=loss, num_params=n_draft, target=str(target_dir),
                   target_num_params=n_target, embedding_init="projected" if projected else "random",
                   heldout_greedy_agreement=greedy_agreement(target, draft, heldout))
    print(f"[draft] held-out greedy agreement {summary['heldout_greedy_agreement']}", flush=True)
    export_hf(draft, tokenizer, out, summary)
    copy_tokenizer_files(target_dir, out)  # byte-identical tokenizer: ids must match the target's
    print(f"[draft] exported to {out}", flush=True)
    return summary
