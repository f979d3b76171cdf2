"""Random-weight GPT-2-family models of real shapes, for benchmarks on machines with no network (bench/gpu.sh).

Random weights say nothing about acceptance: a random draft agrees with a random target about as often as chance,
so the speeds these models give are the cost side of speculation only. bench/gpu.sh therefore pairs the large one
with itself (every draft token accepted: the acceptance upper bound) and with the small one (about none accepted:
the lower bound). The vocabulary is the bundled SmolLM2 tokenizer's (49152), not GPT-2's 50257.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = REPO / "models" / "smollm2-draft-fullvocab"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

# (layers, hidden, heads): the public checkpoints' shapes (untied LM head: +63M parameters for gpt2-large);
# "tiny" is for a CPU smoke run of the script itself
SHAPES = {"gpt2-large": (36, 1280, 20), "distilgpt2": (6, 768, 12), "tiny": (2, 64, 4)}


def build(shape: str, out: Path, seed: int = 0, logit_scale: float = 8.0) -> int:
    """Writes a random GPT-2 model of `shape` with the bundled tokenizer into `out` (fp32 safetensors); returns
    its parameter count.

    The LM head is untied: with a tied one, a random model's argmax is mostly its input token again (h ~ its own
    embedding), and two random models then "agree" on that repetition. It is scaled by `logit_scale` (as the
    tests' tiny models are): default init gives nearly flat logits, whose near-ties would make fp32 greedy
    comparisons hinge on summation order rather than on the engine.
    """
    layers, hidden, heads = SHAPES[shape]
    vocab = json.loads((TOKENIZER_DIR / "config.json").read_text())["vocab_size"]
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=1024,
                     bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    model = GPT2LMHeadModel(cfg)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(logit_scale)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (TOKENIZER_DIR / name).exists():
            shutil.copy(TOKENIZER_DIR / name, out / name)
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.random_models", description=__doc__.splitlines()[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    params = build(args.shape, args.out, args.seed)
    print(f"[random_models] {args.shape}: {params / 1e6:.0f}M parameters -> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
