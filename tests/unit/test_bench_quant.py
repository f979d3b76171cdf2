"""bench/quant_kernels.py runs and reports every kernel; bench/peers.py starts the quantized demo peers with the
flags the server knows."""

import argparse
from pathlib import Path

from bench.peers import peer_commands
from bench.quant_kernels import main


def test_kernel_bench_reports_every_kernel_at_every_row_count(capsys):
    report = main(["--rows", "1,3", "--repeats", "1", "--calls", "1", "--dtype", "float32", "--layers", "1"])
    assert [r["rows"] for r in report["results"]] == [1, 3]
    assert all(r["int8_ms"] > 0 and r["int4_ms"] > 0 and r["dense_ms"] > 0 for r in report["results"])
    assert "| 3 |" in capsys.readouterr().err
    from specserve.engine.model.cpu_kernels import build

    assert ("int4_cpu_ms" in report["results"][0]) == (build.load() is not None)


def test_kernel_bench_times_the_amx_tiles_apart_where_they_exist():
    from specserve.engine.model.cpu_kernels import build, ops

    lib = build.load()
    if lib is None or not ops.amx(lib):
        import pytest
        pytest.skip("no AMX tiles here")
    report = main(["--rows", "8", "--repeats", "1", "--calls", "1", "--layers", "1"])
    assert report["results"][0]["int4_cpu_amx_ms"] > 0 and ops.amx(lib)  # left on, as it found it


def test_quantized_peers_serve_the_demo_target():
    args = argparse.Namespace(concurrency=[1, 4], max_tokens=8, requests_per_level=None, llama_server=None,
                              llama_draft=None, dtype="auto")
    cmds = peer_commands(args, Path("/x/smollm2-135m-instruct-bfloat16"), 8000)
    assert "--dtype" not in cmds["specserve-int4"]  # auto: the engine's own choice for this CPU
    forced = peer_commands(argparse.Namespace(**{**vars(args), "dtype": "float32"}),
                           Path("/x/smollm2-135m-instruct-float32"), 8000)
    assert forced["specserve-int4-default"][-4:] == ["--dtype", "float32", "--quantization", "int4"]
    assert "--model" not in cmds["specserve-int4"] and cmds["specserve-int4"][-3:] == [
        "int4", "--speculative-method", "none"]
    assert cmds["specserve-int4-default"][-2:] == ["--quantization", "int4"]  # the device's demo default method
    assert cmds["specserve-int4-eagle3"][-4:] == ["--quantization", "int4", "--speculative-method", "eagle3"]
    assert "--model" in cmds["specserve-plain"]
    from specserve.config.loader import HELP
    assert "quantization" in HELP


def test_weight_bytes_count_packed_buffers():
    import torch
    from torch import nn

    from bench.quantized import weight_bytes
    from specserve.engine.model.quantize import quantize_linears

    model = nn.Sequential(nn.Linear(64, 32, bias=False))
    dense = weight_bytes(model)
    quantize_linears(model, "int4", torch.float32)
    assert 0 < weight_bytes(model) < dense


def test_peer_rounds_report_the_median_round_and_per_round_ratios():
    from bench.peers import merge_rounds, ratio_table, round_ratios

    def run(peer, *speeds):
        return {"peer": peer, "rows": [{"concurrency": c, "tokens_per_s": v} for c, v in zip((1, 4), speeds)]}
    runs = {"llama.cpp": [run("llama.cpp", 100, 100), run("llama.cpp", 50, 100), run("llama.cpp", 80, 100)],
            "specserve-int4": [run("specserve-int4", 110, 150), run("specserve-int4", 60, 300),
                               {"peer": "specserve-int4", "error": "exited with 1"}]}
    merged = merge_rounds(runs["llama.cpp"])
    assert [r["tokens_per_s"] for r in merged["rows"]] == [80, 100] and merged["rounds"] == 3
    assert merged["rows"][0]["tokens_per_s_rounds"] == [50, 80, 100]
    ratios = round_ratios(runs, "llama.cpp")  # a failed round drops out; rounds pair up by position
    assert ratios["by_peer"]["specserve-int4"] == {"1": 1.15, "4": 2.25}
    assert "| specserve-int4 | 1.15x | 2.25x |" in ratio_table({"concurrency": [1, 4], "ratios": ratios})
    assert round_ratios({"specserve-int4": runs["specserve-int4"]}, "llama.cpp") == {}
    assert merge_rounds([{"peer": "x", "error": "e"}]) == {"peer": "x", "error": "e"}
