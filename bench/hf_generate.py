"""HF `generate()` at batch 1 on the peers' prompts, plain or with `assistant_model` (HF's assisted generation), in
bench/loadgen.py's row shape so that bench/peers.py can put it in the same table (concurrency 1 only: generate()
serves one request at a time). Times come from a streamer: the first new token is the TTFT, the rest the
inter-token interval (assisted generation hands over several tokens at once; they share the interval).

`python -m bench.hf_generate --model HF_DIR [--assistant HF_DIR] [--max-tokens 64] [--requests 8] [--out F]`
"""

from __future__ import annotations

import argparse
import sys
import time

from bench.loadgen import request_timing, summarize_level
from bench.output import emit


class _Clock:
    """A generate() streamer that records when each batch of new tokens arrives (the first put is the prompt)."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.prompt_seen = False
        self.arrivals: list[tuple[float, int]] = []  # (seconds since start, tokens)

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.arrivals.append((time.perf_counter() - self.t0, int(value.numel())))

    def end(self) -> None:
        pass


def one_request(model, tok, prompt: str, max_tokens: int, assistant=None) -> dict:
    import torch

    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    clock = _Clock()
    with torch.inference_mode():
        model.generate(**ids, max_new_tokens=max_tokens, do_sample=False, streamer=clock, assistant_model=assistant,
                       pad_token_id=tok.eos_token_id)
    end = time.perf_counter() - clock.t0
    return request_timing(clock.arrivals[0][0], clock.arrivals[-1][0], end, sum(n for _, n in clock.arrivals))


def run(model_dir: str, assistant_dir: str | None, max_tokens: int, requests: int, dtype: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.prompts import heldout_prompts
    from specserve.engine.model.loader import resolve_dtype

    dt = resolve_dtype(dtype, torch.device("cpu"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt).eval()
    assistant = AutoModelForCausalLM.from_pretrained(assistant_dir, dtype=dt).eval() if assistant_dir else None
    prompts = heldout_prompts()
    one_request(model, tok, prompts[-1], 8, assistant)  # warm-up
    t0 = time.perf_counter()
    results = [one_request(model, tok, prompts[i % len(prompts)], max_tokens, assistant) for i in range(requests)]
    return summarize_level(results, 1, time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.hf_generate", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="HF directory of the target")
    ap.add_argument("--assistant", help="HF directory of a draft with the target's full vocabulary")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    row = run(args.model, args.assistant, args.max_tokens, args.requests, args.dtype)
    emit(row, args.out, f"HF generate{' + assistant' if args.assistant else ''}: {row['tokens_per_s']:.1f} tok/s, "
                        f"p50 inter-token {row['itl_s']['p50'] * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
