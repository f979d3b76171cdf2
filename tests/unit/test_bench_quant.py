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


def test_quantized_peers_serve_the_demo_target():
    args = argparse.Namespace(concurrency=[1, 4], max_tokens=8, requests_per_level=None, llama_server=None,
                              llama_draft=None)
    cmds = peer_commands(args, Path("/x/smollm2-135m-instruct-bfloat16"), 8000)
    assert "--model" not in cmds["specserve-int4"] and cmds["specserve-int4"][-3:] == [
        "int4", "--speculative-method", "none"]
    assert cmds["specserve-int4-eagle3"][-2:] == ["--quantization", "int4"]
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
