"""`specserve train target|draft` argument parsing and dispatch; importable without the server.

Also runnable directly: `python -m engine.train.cli target --out models/demo-target ...`.
"""
from __future__ import annotations

import argparse
import json


def _add_common(p: argparse.ArgumentParser, seq_len: int, lr: float) -> None:
    p.add_argument("--out", required=True, help="output Hugging Face model directory")
    p.add_argument("--corpus", default=None,
                   help="directory of text files or one text file (default: this Python's stdlib)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="wall-clock training budget; the run stops, checkpoints and exports at it")
    p.add_argument("--steps", type=int, default=100_000, help="maximum optimizer steps")
    p.add_argument("--seq-len", type=int, default=seq_len)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-dir", default="",
                   help="checkpoint directory (default ~/.cache/specserve/ckpt/<kind>-<out name>); "
                        "an existing latest.pt there is resumed")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--auto-threads", action="store_true",
                   help="probe --threads vs 1 thread during training and keep the faster (shared CPUs)")
    p.add_argument("--log-every", type=int, default=10)


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    """Adds `train` with `target` and `draft` sub-subcommands to an argparse subparsers object."""
    train = subparsers.add_parser("train", help="train the demo target or distil a draft")
    kinds = train.add_subparsers(dest="train_kind", required=True)
    target = kinds.add_parser("target", help="train a small Llama target and its tokenizer")
    _add_common(target, seq_len=512, lr=1.5e-3)
    target.add_argument("--vocab-size", type=int, default=8192)
    target.add_argument("--num-layers", type=int, default=12)
    target.add_argument("--hidden-size", type=int, default=384)
    target.add_argument("--intermediate-size", type=int, default=1024)
    target.add_argument("--num-heads", type=int, default=6)
    target.add_argument("--num-kv-heads", type=int, default=2)
    draft = kinds.add_parser("draft", help="distil a small draft from any HF causal-LM target")
    _add_common(draft, seq_len=512, lr=2e-3)
    draft.add_argument("--target", required=True, help="HF causal-LM target directory")
    draft.add_argument("--num-layers", type=int, default=1)
    draft.add_argument("--hidden-size", type=int, default=256)
    draft.add_argument("--intermediate-size", type=int, default=768)
    draft.add_argument("--num-heads", type=int, default=4)
    draft.add_argument("--num-kv-heads", type=int, default=4)
    draft.add_argument("--init", choices=("project", "random"), default="project",
                       help="draft embedding init: PCA projection of the target's, or random")
    draft.add_argument("--loss", choices=("fkl", "tvd"), default="fkl",
                       help="forward KL(target||draft) or total variation distance (DistillSpec)")
    train.set_defaults(func=run_train)
    return train


def run_train(args: argparse.Namespace) -> dict:
    from .loop import TrainConfig

    cfg = TrainConfig(steps=args.steps, seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr,
                      warmup_steps=args.warmup_steps, seed=args.seed, max_minutes=args.max_minutes,
                      threads=args.threads, auto_threads=args.auto_threads,
                      ckpt_dir=args.ckpt_dir, log_every=args.log_every)
    model_kwargs = dict(num_layers=args.num_layers, hidden=args.hidden_size,
                        intermediate=args.intermediate_size, heads=args.num_heads,
                        kv_heads=args.num_kv_heads)
    if args.train_kind == "target":
        from .target import train_target
        return train_target(args.out, cfg, corpus=args.corpus, vocab_size=args.vocab_size,
                            model_kwargs=model_kwargs)
    if args.train_kind == "draft":
        from .distill import train_draft
        return train_draft(args.target, args.out, cfg, corpus=args.corpus, model_kwargs=model_kwargs,
                           init=args.init, loss=args.loss)
    raise ValueError(f"train_kind: expected 'target' or 'draft', got {args.train_kind!r}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.train.cli")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_train_parser(subparsers)
    args = parser.parse_args(["train", *(argv if argv is not None else __import__("sys").argv[1:])])
    summary = run_train(args)
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}, default=str))


if __name__ == "__main__":
    main()
