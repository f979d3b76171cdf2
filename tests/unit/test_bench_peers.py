"""bench/peers.py --interleave: every server starts once, and each round alternates the servers level by level."""

import types
from itertools import count

from bench import peers


def test_interleaved_rounds_alternate_servers_level_by_level(monkeypatch, tmp_path):
    ports, calls, started, stopped = count(9000), [], [], []
    monkeypatch.setattr(peers, "free_port", lambda: next(ports))
    monkeypatch.setattr(peers, "peer_commands", lambda args, hf_dir, port: {n: [n, str(port)] for n in ("a", "b")})

    def start(name, cmd, url, model):
        started.append(name)
        return f"proc-{name}", f"model-{name}"
    monkeypatch.setattr(peers, "start_server", start)
    monkeypatch.setattr(peers, "stop_server", stopped.append)

    async def fake_run(url, model, levels, max_tokens, requests):
        calls.append((model, levels))
        return [{"concurrency": c, "tokens_per_s": 10.0 * c * (2 if model == "model-b" else 1)} for c in levels]
    monkeypatch.setattr(peers.loadgen, "run", fake_run)
    args = types.SimpleNamespace(concurrency=[1, 4], rounds=2, max_tokens=8, requests_per_level=4)
    runs = peers.run_interleaved(["a", "b"], args, tmp_path)
    assert started == ["a", "b"] and sorted(stopped) == ["proc-a", "proc-b"]  # once each
    assert calls == [("model-a", [1]), ("model-b", [1]), ("model-a", [4]), ("model-b", [4])] * 2
    assert [len(r) for r in runs.values()] == [2, 2]
    assert runs["b"][1]["rows"] == [{"concurrency": 1, "tokens_per_s": 20.0}, {"concurrency": 4, "tokens_per_s": 80.0}]
    ratios = peers.round_ratios({"llama.cpp": runs["a"], "b": runs["b"]}, "llama.cpp")
    assert ratios["by_peer"]["b"] == {"1": 2.0, "4": 2.0}
