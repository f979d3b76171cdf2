"""Train the demo target: a small Llama-architecture causal LM on packed corpus text.

GQA (6 query heads, 2 KV heads) as in Llama 3 / Qwen, so the demo exercises the engine's grouped KV path.
"""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from .corpus import load_corpus
from .loop import (
    TrainConfig,
    cached_tokens,
    default_ckpt_dir,
    eval_batches,
    export_hf,
    pack_tokens,
    run_loop,
    setup_runtime,
)
from .tokenizer import load_or_train_tokenizer


def target_config(vocab_size: int, eos_id: int, num_layers: int = 12, hidden: int = 384,
                  intermediate: int = 1024, heads: int = 6, kv_heads: int = 2) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        rope_theta=10_000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,  # 3M params saved; the 8K-vocab embedding is 14% of the model
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        initializer_range=0.02,
    )


def causal_lm_loss(model):
    def loss_fn(batch: torch.Tensor) -> torch.Tensor:
        return model(input_ids=batch, labels=batch).loss  # HF shifts labels by one inside
    return loss_fn


def train_target(out: str | Path, cfg: TrainConfig, corpus: str | None = None,
                 vocab_size: int = 8192, model_kwargs: dict | None = None) -> dict:
    """Tokenizer (trained once, kept in the checkpoint dir) -> packed tokens -> model -> HF export."""
    ckpt_dir = Path(cfg.ckpt_dir) if cfg.ckpt_dir else default_ckpt_dir("target", out)
    cfg.ckpt_dir = str(ckpt_dir)
    setup_runtime(cfg)
    data = load_corpus(corpus)
    tokenizer = load_or_train_tokenizer(ckpt_dir / "tokenizer", data.iter_texts("train"), vocab_size)
    eos = tokenizer.eos_token_id
    tokens = cached_tokens(ckpt_dir / "train_tokens.pt",
                           lambda: pack_tokens(tokenizer, data.iter_texts("train"), eos))
    heldout_tokens = cached_tokens(ckpt_dir / "heldout_tokens.pt",
                                   lambda: pack_tokens(tokenizer, data.iter_texts("heldout"), eos))
    print(f"[target] corpus {data.root} files={len(data.files)} train_tokens={len(tokens)} "
          f"heldout_tokens={len(heldout_tokens)}", flush=True)

    torch.manual_seed(cfg.seed)
    config = target_config(len(tokenizer), eos, **(model_kwargs or {}))
    model = LlamaForCausalLM(config)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"[target] params={num_params / 1e6:.2f}M config={config.num_hidden_layers}x"
          f"{config.hidden_size} kv_heads={config.num_key_value_heads}", flush=True)

    summary = run_loop(model, causal_lm_loss(model), tokens, eval_batches(heldout_tokens, cfg),
                       cfg, ckpt_dir, desc="target")
    summary.update(kind="target", num_params=num_params, corpus=str(data.root),
                   num_files=len(data.files), train_tokens=len(tokens))
    export_hf(model, tokenizer, out, summary)
    print(f"[target] exported to {out}", flush=True)
    return summary
