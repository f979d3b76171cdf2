"""Plain-HF measurements of a target/draft pair: per-token cost ratio c and greedy/sampled agreement.

`python -m specserve.train.measure --target models/demo-target --draft models/demo-draft` prints JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from .corpus import heldout_prompts, load_corpus
from .loop import train_dtype


@torch.inference_mode()
def decode_ms(model, context: torch.Tensor, new_tokens: int = 1, steps: int = 48, repeats: int = 3) -> float:
    """Median ms of one forward of `new_tokens` tokens at batch 1 after a cached `context` prefill."""
    times = []
    for _ in range(repeats):
        cache = DynamicCache()
        model(input_ids=context, cache=cache, use_cache=True)
        nxt = context[:, -new_tokens:]
        for _ in range(steps):
            t0 = time.perf_counter()
            model(input_ids=nxt, cache=cache, use_cache=True)
            times.append(time.perf_counter() - t0)
            cache.crop(-new_tokens)  # verify-style rollback: every step sees the same context length
    return 1000 * statistics.median(times)


@torch.inference_mode()
def agreement(target, draft, prompts: list[torch.Tensor], gen_len: int = 48, k: int = 4) -> dict:
    """On the target's own greedy continuations: P(draft argmax == target token) (greedy acceptance
    proxy), mean sum(min(p, q)) (acceptance at temperature 1), and simulated greedy tokens/target step."""
    hits = total = 0
    overlap = []
    accepted_lengths = []
    for ids in prompts:
        out = target.generate(ids, max_new_tokens=gen_len, do_sample=False, min_new_tokens=gen_len)
        n = ids.shape[1]
        p = torch.softmax(target(input_ids=out).logits[0, n - 1:-1].float(), -1)  # [G, V]
        q = torch.softmax(draft(input_ids=out).logits[0, n - 1:-1].float(), -1)
        match = (q.argmax(-1) == out[0, n:]).tolist()
        hits += sum(match)
        total += len(match)
        overlap.append(float(torch.minimum(p, q).sum(-1).mean()))
        i = 0
        while i < len(match):  # greedy speculative decoding: accept the matching prefix, +1 token
            run = 0
            while run < k and i + run < len(match) and match[i + run]:
                run += 1
            accepted_lengths.append(run + 1)
            i += run + 1
    return {"greedy_agreement": round(hits / total, 4),
            "sampled_acceptance_t1": round(statistics.mean(overlap), 4),
            f"greedy_tokens_per_target_step_k{k}": round(statistics.mean(accepted_lengths), 3),
            "positions": total, "num_prompts": len(prompts)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m specserve.train.measure")
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--gen-len", type=int, default=48)
    ap.add_argument("--corpus", default=None)
    ap.add_argument("--cost-only", action="store_true", help="skip the agreement measurement")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.target)
    dtype = train_dtype()
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).eval()
    draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=dtype).eval()
    corpus = load_corpus(args.corpus)
    text = "".join(corpus.iter_texts("heldout"))
    context = tok(text, return_tensors="pt")["input_ids"][:, : args.context]
    cost = {"context_tokens": context.shape[1]}
    for name, model in (("target", target), ("draft", draft)):
        decode_ms(model, context, steps=8, repeats=1)  # warm-up: first calls allocate
        cost[f"{name}_ms_1_token"] = round(decode_ms(model, context, 1), 3)
    cost["target_ms_5_tokens"] = round(decode_ms(target, context, 5), 3)
    cost["c"] = round(cost["draft_ms_1_token"] / cost["target_ms_1_token"], 4)
    deeper_cfg = draft.config.__class__(**{**draft.config.to_dict(),
                                           "num_hidden_layers": draft.config.num_hidden_layers + 1})
    deeper = type(draft)(deeper_cfg).to(dtype).eval()
    decode_ms(deeper, context, steps=8, repeats=1)
    cost[f"draft_{deeper_cfg.num_hidden_layers}_layers_ms_1_token"] = round(decode_ms(deeper, context, 1), 3)
    prompts = [tok(p, return_tensors="pt")["input_ids"] for p in heldout_prompts(corpus, args.num_prompts)]
    agree = None if args.cost_only else agreement(target, draft, prompts, gen_len=args.gen_len)
    result = {"machine": f"{platform.machine()} {os.cpu_count()} CPUs, threads={args.threads}",
              "dtype": str(dtype).removeprefix("torch."), "batch": 1, "cost": cost,
              "agreement": agree,
              "target_params": sum(p.numel() for p in target.parameters()),
              "draft_params": sum(p.numel() for p in draft.parameters())}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
