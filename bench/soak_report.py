"""The soak's report: latency percentiles, RSS and KV summaries, the pass/fail checks and the summary table."""

from __future__ import annotations

RSS_FLAT_RATIO = 1.10


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0, "p50": None, "p95": None, "p99": None}
    xs = sorted(values)

    def q(p):  # linear interpolation between closest ranks
        pos = (len(xs) - 1) * p
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        return round(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo), 4)

    return {"n": len(xs), "p50": q(0.50), "p95": q(0.95), "p99": q(0.99), "max": round(xs[-1], 4)}


def rss_summary(samples: list[dict], warmup_s: float) -> dict:
    points = [(s["t"], s["rss_mb"]) for s in samples if s.get("rss_mb") is not None]
    if not points:
        return {"first_mb": None}
    after = [rss for t, rss in points if t >= warmup_s] or [points[-1][1]]
    post_warmup, last = after[0], points[-1][1]
    return {"first_mb": round(points[0][1], 1), "after_warmup_mb": round(post_warmup, 1),
            "max_mb": round(max(r for _, r in points), 1), "last_mb": round(last, 1),
            "last_over_warmup": round(last / post_warmup, 3), "flat": last <= RSS_FLAT_RATIO * post_warmup,
            "warmup_s": round(warmup_s, 1)}


def kv_summary(samples: list[dict]) -> dict:
    kv = [s["kv"] for s in samples if "kv" in s]
    if not kv:
        return {"max": None}
    return {"max": round(max(kv), 4), "mean": round(sum(kv) / len(kv), 4), "last_sample": kv[-1],
            "max_running": max((s.get("running", 0) for s in samples), default=0),
            "max_waiting": max((s.get("waiting", 0) for s in samples), default=0)}


def failures_of(report: dict, strict_rss: bool) -> list[str]:
    out = []
    o = report["requests"]["by_outcome"]
    for key, n in sorted(o.items()):
        if key.startswith(("5xx:", "5xx_invalid:", "invalid_accepted:", "abuse_accepted:")) or key in (
                "hung", "stream_error", "stream_truncated", "transport_error", "abuse_held"):
            out.append(f"{n} request(s) with outcome {key}")
    final = report["final_gauges"]
    if not final.get("idle"):
        out.append(f"the server did not go idle with an empty KV cache: {final}")
    if report["server"].get("exited_during_load") is not None:
        out.append(f"the server exited with {report['server']['exited_during_load']} during the load")
    if report["server"]["exit_code"] != 0:
        out.append(f"server exit code {report['server']['exit_code']} after SIGTERM (None: killed)")
    if strict_rss and report["rss"].get("flat") is False:
        out.append(f"RSS grew after warm-up: {report['rss']}")
    return out


def summary_table(report: dict) -> str:
    lines = ["", f"## soak: {report['config']['minutes']} min x {report['config']['concurrency']} workers, "
                 f"model {report['model']}", "", "| outcome | count |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in sorted(report["requests"]["by_outcome"].items())]
    lines += ["", "| kind | " + " | ".join(sorted(report["requests"]["by_outcome"])) + " |",
              "|---|" + "---|" * len(report["requests"]["by_outcome"])]
    for kind, counts in sorted(report["requests"]["by_kind"].items()):
        lines.append(f"| {kind} | " + " | ".join(str(counts.get(k, 0)) for k in
                                                 sorted(report["requests"]["by_outcome"])) + " |")
    lines += ["", "| latency (s) | n | p50 | p95 | p99 |", "|---|---|---|---|---|"]
    for name, p in [*report["latency_s"].items(), ("ttft (streams)", report["ttft_s"])]:
        lines.append(f"| {name} | {p['n']} | {p['p50']} | {p['p95']} | {p['p99']} |")
    t, rss, kv = report["throughput"], report["rss"], report["kv"]
    lines += ["", f"throughput: {t['completion_tokens']} completion tokens in {t['load_seconds']} s = "
                  f"{t['tokens_per_s']} tok/s, {t['requests_per_s']} req/s",
              f"RSS MiB: first {rss.get('first_mb')}, after warm-up {rss.get('after_warmup_mb')}, "
              f"max {rss.get('max_mb')}, last {rss.get('last_mb')} -> flat: {rss.get('flat')}",
              f"KV usage: max {kv.get('max')}, mean {kv.get('mean')}; max running {kv.get('max_running')}, "
              f"max waiting {kv.get('max_waiting')}",
              f"server counters: {report['server_counters']}",
              f"after the load: {report['final_gauges']} (idle after {report['idle_wait_s']} s)",
              f"server: exit code {report['server']['exit_code']} after SIGTERM in "
              f"{report['server']['shutdown_s']} s; log {report['server']['log']}",
              "", "RESULT: " + ("PASS" if report["passed"] else "FAIL: " + "; ".join(report["failures"]))]
    return "\n".join(lines)
