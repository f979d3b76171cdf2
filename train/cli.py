"""`specserve train target|draft|selfgen|teacher|selfdistill|medusa|dflash|eagle3`: argument parsing and dispatch; no
server imports.

Also runnable directly: `python -m specserve.train.cli target --out models/demo-target ...`.
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
    gen = kinds.add_parser("selfgen", help="grow a corpus of the target's own answers (token ids, kept in git)")
    gen.add_argument("--target", default=None, help="target model: HF directory or .gguf file (default: the demo)")
    gen.add_argument("--out", default="models/corpus/smollm2",
                     help="corpus directory (manifest.json + shards; a rerun appends what is missing)")
    gen.add_argument("--max-minutes", type=float, required=True, help="generation budget")
    gen.add_argument("--max-tokens", type=int, default=192)
    gen.add_argument("--batch", type=int, default=48, help="sequences decoded together")
    gen.add_argument("--shard-size", type=int, default=256, help="answers per shard")
    gen.add_argument("--max-answers", type=int, default=None, help="stop after starting this many answers")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--passes", type=int, default=2,
                     help="answers per prompt: pass 0 greedy, pass 1 at temperature 0.8, later passes at 1.0")
    gen.add_argument("--threads", type=int, default=None)
    sd = kinds.add_parser("selfdistill", help="distil a draft on a selfgen set (the target's own answers)")
    _add_common(sd, seq_len=512, lr=1e-3)
    sd.add_argument("--target", required=True, help="target model: HF directory or .gguf file")
    sd.add_argument("--data", required=True, help="directory written by `train selfgen`")
    sd.add_argument("--draft-vocab", type=int, default=0,
                    help="sub-vocabulary size (most frequent target tokens + a vocabulary map); 0 = full vocabulary")
    sd.add_argument("--init-layers", default="",
                    help="comma-separated target layers to initialise from (the draft then has the target's width)")
    sd.add_argument("--init-draft", default=None,
                    help="continue from an exported draft directory (its weights and vocabulary map)")
    sd.add_argument("--freeze-embeddings", action="store_true",
                    help="keep the (tied) embedding / LM head as initialised; train the body only")
    sd.add_argument("--num-layers", type=int, default=1)
    sd.add_argument("--hidden-size", type=int, default=256)
    sd.add_argument("--intermediate-size", type=int, default=768)
    sd.add_argument("--num-heads", type=int, default=4)
    sd.add_argument("--num-kv-heads", type=int, default=4)
    md = kinds.add_parser("medusa", help="Medusa heads on a selfgen set: stage 1 (frozen base) or stage 2 (joint)")
    _add_common(md, seq_len=1024, lr=1e-3)
    md.add_argument("--model", "--target", dest="target", required=True,
                    help="target model: HF directory or .gguf file")
    md.add_argument("--data", required=True, help="directory written by `train selfgen`")
    md.add_argument("--stage", type=int, choices=(1, 2), default=1,
                    help="1: heads on the frozen target; 2: heads warm-up, then joint training (writes a new target)")
    md.add_argument("--medusa-num-heads", type=int, default=4)
    md.add_argument("--medusa-num-layers", type=int, default=1, help="ResBlocks per head")
    md.add_argument("--init-heads", default=None,
                    help="start from these exported heads (stage 1: continue training; stage 2: no warm-up)")
    md.add_argument("--head-warmup-steps", type=int, default=50, help="stage 2: heads-only steps before joint")
    md.add_argument("--base-lr-scale", type=float, default=0.1, help="stage 2: the base's lr as a multiple of --lr")
    md.add_argument("--lm-loss-weight", type=float, default=1.0, help="stage 2: weight of the base's own LM loss")
    md.add_argument("--no-tree", action="store_true", help="skip measuring verify costs and choosing the tree")
    df = kinds.add_parser("dflash", help="a DFlash block-diffusion drafter on a selfgen set (frozen target)")
    _add_common(df, seq_len=1024, lr=6e-4)
    df.add_argument("--model", "--target", dest="target", required=True,
                    help="target model: HF directory or .gguf file")
    df.add_argument("--data", required=True, help="directory written by `train selfgen`")
    df.add_argument("--num-layers", type=int, default=2, help="drafter layers")
    df.add_argument("--block-size", type=int, default=8, help="block size B: one forward drafts B - 1 tokens")
    df.add_argument("--target-layer-ids", default="",
                    help="comma-separated target layers whose outputs form the context (default: z-lab's spacing)")
    df.add_argument("--num-context-layers", type=int, default=0,
                    help="with the default spacing: how many target layers (default: one per drafter layer)")
    df.add_argument("--mask-token-id", type=int, default=None,
                    help="the MASK id (default: the highest special token id the data never uses)")
    df.add_argument("--num-anchors", type=int, default=16, help="blocks per sequence per step")
    df.add_argument("--gamma", type=float, default=None,
                    help="loss weight of block position k: exp(-(k - 1) / gamma) (default 4 for B <= 8, else 7)")
    df.add_argument("--init-layers", default="",
                    help="comma-separated target layers initialising the drafter's layers (one each)")
    df.add_argument("--vocab-map", default=None,
                    help="vocab_map.safetensors (int64 d2t) restricting the LM head to those target ids")
    df.add_argument("--intermediate-size", type=int, default=0, help="drafter MLP width (default: the target's)")
    df.add_argument("--init-drafter", default=None,
                    help="continue from an exported drafter (its shape, context layers and vocabulary map)")
    e3 = kinds.add_parser("eagle3", help="an EAGLE-3 drafter on the kept corpus (frozen target, training-time test)")
    _add_common(e3, seq_len=512, lr=1e-3)
    e3.add_argument("--model", "--target", dest="target", default=None,
                    help="target model: HF directory or .gguf file (default: the demo target)")
    e3.add_argument("--data", default="models/corpus/smollm2", help="the corpus (or an older selfgen directory)")
    e3.add_argument("--ttt-steps", type=int, default=4, help="training-time test: steps the drafter is unrolled")
    e3.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size (0: the target's)")
    e3.add_argument("--layer-ids", default="",
                    help="the 3 target layers read, as HF hidden_states indices (default: 2, N//2, N-3)")
    e3.add_argument("--batch-tokens", type=int, default=2048, help="padded tokens per training batch")
    e3.add_argument("--max-sequences", type=int, default=None, help="use only the first N answers (a quick run)")
    e3.add_argument("--init-drafter", default=None,
                    help="continue from an exported drafter (its weights and draft vocabulary)")
    e3.add_argument("--curve-every", type=int, default=0,
                    help="every N training tokens, the held-out report (acceptance against data seen)")
    tt = kinds.add_parser("teacher", help="fill the per-shard teacher store once for every trainer (taps, top-k)")
    tt.add_argument("--model", "--target", dest="target", default=None,
                    help="target model: HF directory or .gguf file (default: the demo target)")
    tt.add_argument("--data", default="models/corpus/smollm2", help="the corpus")
    tt.add_argument("--taps", default="1,8,14,20,26,27,-1",
                    help="decoder-layer outputs to keep (-1: the final norm's); the default covers the demo's "
                         "EAGLE-3 (1, 14, 26), DFlash (1, 8, 14, 20, 27) and Medusa (-1)")
    tt.add_argument("--top-k", type=int, default=20)
    tt.add_argument("--threads", type=int, default=None)
    train.set_defaults(func=run_train)
    return train


def _run_selfgen(args: argparse.Namespace) -> dict:
    import torch

    from .selfgen import generate_answers
    if args.threads:
        torch.set_num_threads(args.threads)
    return generate_answers(args.target, args.out, args.max_minutes, max_tokens=args.max_tokens, batch=args.batch,
                            shard_size=args.shard_size, seed=args.seed, passes=args.passes,
                            max_answers=args.max_answers)


def _run_teacher(args: argparse.Namespace) -> dict:
    import torch

    from specserve.engine.model.loader import demo_model_paths

    from .loop import compute_autocast
    from .medusa import load_target
    from .teacher import precompute
    if args.threads:
        torch.set_num_threads(args.threads)
    target_path = args.target or str(demo_model_paths()[0])
    target = load_target(target_path, torch.bfloat16).eval()
    return precompute(target, target_path, args.data, _int_list(args.taps) or [], args.top_k, compute_autocast())


def _int_list(text: str) -> list[int] | None:
    """"1,4,7" -> [1, 4, 7]; empty -> None."""
    return [int(x) for x in text.split(",") if x.strip()] or None


def run_train(args: argparse.Namespace) -> dict:
    from .loop import TrainConfig

    if args.train_kind == "selfgen":
        return _run_selfgen(args)
    if args.train_kind == "teacher":
        return _run_teacher(args)
    cfg = TrainConfig(steps=args.steps, seq_len=args.seq_len, batch_size=args.batch_size, lr=args.lr,
                      warmup_steps=args.warmup_steps, seed=args.seed, max_minutes=args.max_minutes,
                      threads=args.threads, auto_threads=args.auto_threads,
                      ckpt_dir=args.ckpt_dir, log_every=args.log_every)
    if args.train_kind == "medusa":
        from .medusa import train_stage1, train_stage2
        common = dict(num_heads=args.medusa_num_heads, num_layers=args.medusa_num_layers, max_len=args.seq_len,
                      choose=not args.no_tree)
        if args.stage == 1:
            return train_stage1(args.target, args.data, args.out, cfg, init_heads=args.init_heads, **common)
        return train_stage2(args.target, args.data, args.out, cfg, init_heads=args.init_heads,
                            warmup_steps=args.head_warmup_steps, base_lr_scale=args.base_lr_scale,
                            lm_weight=args.lm_loss_weight, **common)
    if args.train_kind == "dflash":
        from .dflash import train_dflash
        return train_dflash(args.target, args.data, args.out, cfg, num_layers=args.num_layers,
                            block_size=args.block_size, target_layer_ids=_int_list(args.target_layer_ids),
                            num_context_layers=args.num_context_layers or None, mask_token_id=args.mask_token_id,
                            num_anchors=args.num_anchors, gamma=args.gamma, init_layers=_int_list(args.init_layers),
                            vocab_map=args.vocab_map, intermediate_size=args.intermediate_size or None,
                            max_len=args.seq_len, init_drafter=args.init_drafter)
    if args.train_kind == "eagle3":
        from specserve.engine.model.loader import demo_model_paths

        from .eagle3 import train_eagle3
        target = args.target or str(demo_model_paths()[0])
        return train_eagle3(target, args.data, args.out, cfg, ttt_steps=args.ttt_steps, draft_vocab=args.draft_vocab,
                            layer_ids=_int_list(args.layer_ids), max_len=args.seq_len, batch_tokens=args.batch_tokens,
                            max_sequences=args.max_sequences, init_drafter=args.init_drafter,
                            curve_every=args.curve_every)
    model_kwargs = dict(num_layers=args.num_layers, hidden=args.hidden_size,
                        intermediate=args.intermediate_size, heads=args.num_heads,
                        kv_heads=args.num_kv_heads)
    if args.train_kind == "target":
        from .target import train_target
        return train_target(args.out, cfg, corpus=args.corpus, vocab_size=args.vocab_size,
                            model_kwargs=model_kwargs)
    if args.train_kind == "selfdistill":
        from .selfdistill import train_selfdistill
        layers = [int(x) for x in args.init_layers.split(",") if x.strip()]
        return train_selfdistill(args.target, args.data, args.out, cfg, draft_vocab=args.draft_vocab,
                                 init_layers=layers, model_kwargs=model_kwargs, max_len=args.seq_len,
                                 freeze_embeddings=args.freeze_embeddings, init_draft=args.init_draft)
    if args.train_kind == "draft":
        from .distill import train_draft
        return train_draft(args.target, args.out, cfg, corpus=args.corpus, model_kwargs=model_kwargs,
                           init=args.init, loss=args.loss)
    raise ValueError(f"train_kind: expected 'target' or 'draft', got {args.train_kind!r}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m specserve.train.cli")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_train_parser(subparsers)
    args = parser.parse_args(["train", *(argv if argv is not None else __import__("sys").argv[1:])])
    summary = run_train(args)
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}, default=str))


if __name__ == "__main__":
    main()
