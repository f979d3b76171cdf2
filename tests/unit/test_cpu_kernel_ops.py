"""The CPU kernels (engine/model/cpu_kernels): each against the product or attention it computes, in fp64, and the
property the engine's exactness rests on: a row's result does not depend on the other rows of the call."""

import logging
import os

import pytest
import torch

from specserve.engine.model.attention import _manual_attention
from specserve.engine.model.cpu_kernels import build, ops
from specserve.engine.model.quantize import Int4Linear, int4_codes

pytestmark = pytest.mark.skipif(build.load() is None, reason="no C compiler to build the CPU kernels")
LEVELS = build.runnable_levels() if build.compiler() else []
if os.environ.get("SPECSERVE_TEST_CPU_LEVELS"):  # a subset, e.g. the sanitized run's (test_cpu_kernel_sanitized.py)
    LEVELS = [level for level in LEVELS if level in os.environ["SPECSERVE_TEST_CPU_LEVELS"].split(",")]


@pytest.fixture(scope="module", params=LEVELS)
def lib(request):
    """The kernels built for each level this CPU executes, not only its own (portable C, x86-64-v3, v4, ..., native):
    every test that takes `lib` runs at each."""
    return build.open_library(build.level_library(build.compiler(), request.param))


def q4_weights(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    codes, scales, minima = int4_codes(torch.randn(n, k, generator=g))
    dense = (codes.double().view(n, k // 32, 32) * scales.double()[..., None] + minima.double()[..., None]).view(n, k)
    return ops.pack_q4(codes, scales, minima), (codes, scales, minima), dense


def test_q4_packing_round_trips():
    packed, (codes, scales, minima), _ = q4_weights(48, 96)
    assert packed[0].dtype == torch.uint8 and packed[0].numel() == 48 * 96 // 2
    back = ops.unpack_q4(*packed)
    assert torch.equal(back[0], codes) and torch.equal(back[1], scales) and torch.equal(back[2], minima)


def test_q4_linear_is_the_dequantized_product_row_by_row(lib):
    packed, _, dense = q4_weights(80, 96)
    bias = torch.randn(80)
    x = torch.randn(9, 96)  # 9 rows: two blocks of four and a remainder
    y = ops.q4_linear(lib, x, *packed, bias)
    assert y.dtype == torch.float32 and y.shape == (9, 80)
    expected = x.double() @ dense.T + bias.double()
    assert torch.allclose(y.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    for r in range(9):  # each row alone: bit for bit what it was in the batch
        assert torch.equal(ops.q4_linear(lib, x[r:r + 1], *packed, bias)[0], y[r])


def with_amx(lib, on: bool) -> bool:
    """Switch the process's AMX use (the library's state); -> whether it is on."""
    return bool(lib.specserve_amx(int(on)))


def test_a_bf16_models_int4_product_is_the_same_bit_for_bit_at_every_row_count_tiles_or_not(lib):
    """A bf16 model's int4 product rounds its activations to bf16; where the CPU has AMX, calls of AMX_MIN_ROWS rows
    or more run on its tiles and smaller ones on multiply-adds that repeat the tiles' arithmetic: every row's result
    is bit for bit the same in a call of 1, 3, 7 or 20 rows (tile chunks of 16 and 4), tiles on or off, so a bf16
    model's greedy speculative output stays its plain output."""
    packed, _, dense = q4_weights(80, 96)
    bias = torch.randn(80)
    x = torch.randn(20, 96)
    x[3, 5] = 1e-39  # a bf16 denormal: the tiles read it as zero, and so does the twin
    expected = x.bfloat16().double() @ dense.T + bias.double()
    was = ops.amx(lib)
    results = []
    try:
        for amx in (True, False):
            if with_amx(lib, amx) != amx:
                continue  # no AMX here: the twin alone
            y = ops.q4_linear_bf16_products(lib, x, *packed, bias)
            assert torch.allclose(y.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
            for width in (1, 3, 7):
                for r0 in range(0, 20, width):
                    part = ops.q4_linear_bf16_products(lib, x[r0:r0 + width], *packed, bias)
                    assert torch.equal(part, y[r0:r0 + width]), (amx, width, r0)
            results.append(y)
    finally:
        with_amx(lib, was)
    assert all(torch.equal(y, results[0]) for y in results)
    xb = x.bfloat16()  # the bf16 entry point (a bf16 model's activations) computes the same, then rounds it
    assert torch.equal(ops.q4_linear(lib, xb, *packed, bias), ops.q4_linear_bf16_products(lib, xb.float(), *packed,
                                                                                           bias).bfloat16())


def test_int4_linear_on_the_kernels_applies_its_dequantized_weight(lib):
    linear = torch.nn.Linear(64, 48)
    layer = Int4Linear(linear, torch.float32, kernels=lib)
    assert layer.kernels is lib and not hasattr(layer, "packed")
    x = torch.randn(3, 2, 64)
    expected = x.double() @ layer.dequantized().double().T + linear.bias.double()
    assert torch.allclose(layer(x).double(), expected, atol=1e-5)
    # what torch's kernel would run is the same quantization (its scales in the activations' dtype)
    assert torch.allclose(Int4Linear(linear, torch.float32).dequantized(), layer.dequantized(), atol=1e-6)


def test_q4_linear_refuses_what_does_not_fit(lib):
    packed, _, _ = q4_weights(32, 64)
    with pytest.raises(ValueError, match="q4_linear"):
        ops.q4_linear(lib, torch.randn(2, 32), *packed, None)
    with pytest.raises(ValueError, match="q4_linear"):
        ops.q4_linear(lib, torch.randn(2, 64, dtype=torch.float16), *packed, None)


def q8_weights(n: int, k: int):
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    codes.view(n, k // 32, 32)[..., 5] = -127  # every group reaches |code| 127, as Q8_0's do
    scales = (torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3).half().float()  # GGUF keeps fp16 scales
    return codes, scales, (codes.float().view(n, k // 32, 32) * scales[..., None]).view(n, k)


def test_q8_codes_are_recovered_exactly_or_not_at_all():
    codes, scales, weight = q8_weights(32, 64)
    found = ops.q8_codes(weight)
    assert found is not None and torch.equal(found[0], codes) and torch.equal(found[1], scales)
    assert ops.q8_codes(weight + 1e-4) is None  # not 8-bit groups: kept dense
    assert ops.q8_codes(torch.randn(32, 64)) is None
    assert ops.q8_codes(weight.bfloat16()) is None  # only the fp32 weights a quantized load reads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q8_linear_is_the_product_row_by_row(lib, dtype):
    codes, scales, weight = q8_weights(64, 96)
    packed = ops.pack_q8(codes, scales)
    x = torch.randn(6, 96).to(dtype)
    y = ops.q8_linear(lib, x, *packed)
    assert y.dtype == torch.float32
    assert torch.allclose(y.double(), x.double() @ weight.double().T, atol=1e-5)
    for r in range(6):
        assert torch.equal(ops.q8_linear(lib, x[r:r + 1], *packed)[0], y[r])


def attention_case(dtype, batch=3, q_max=4, length=40, heads=6, kv_heads=2, head_dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    slots_total = batch * length + 8
    k_rows = torch.randn(slots_total, kv_heads * head_dim, generator=g).to(dtype)
    v_rows = torch.randn(slots_total, kv_heads * head_dim, generator=g).to(dtype)
    slots = torch.stack([torch.randperm(slots_total, generator=g)[:length] for _ in range(batch)])
    mask = torch.rand(batch, q_max, length, generator=g) > 0.4  # any pattern: causal, windows, trees are masks
    mask[..., 0] = True
    tokens = batch * q_max
    q = torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
    query_index = torch.arange(tokens).view(batch, q_max)
    kk = k_rows.double()[slots.view(-1)].view(batch, length, kv_heads, head_dim).transpose(1, 2)
    vv = v_rows.double()[slots.view(-1)].view(batch, length, kv_heads, head_dim).transpose(1, 2)
    ref = _manual_attention(q.double()[query_index].transpose(1, 2), kk, vv, mask[:, None], 0.25, None, None)
    return q, k_rows, v_rows, kv_heads, slots, mask, ref.transpose(1, 2).reshape(tokens, heads, head_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(6, 2, 16), (9, 3, 64), (14, 2, 128), (4, 4, 64)])
def test_attention_is_masked_softmax_attention_over_the_pool(lib, dtype, heads, kv_heads, head_dim):
    """Any head size (64 and 128 have a register path: query heads 4 at a time, here 3, 4 + 3 and 1 a group)."""
    q, k_rows, v_rows, kv_heads, slots, mask, ref = attention_case(dtype, heads=heads, kv_heads=kv_heads,
                                                                   head_dim=head_dim)
    rows = torch.arange(q.shape[0])
    out = torch.full_like(q, 7.0)
    ops.attention(lib, q, k_rows, v_rows, kv_heads, slots, mask, rows, rows, 0.25, out)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out.double(), ref, atol=tol)
    # a subset of rows: those rows bit for bit, the others untouched
    some = torch.tensor([1, 6, 11])
    part = torch.full_like(q, 7.0)
    ops.attention(lib, q, k_rows, v_rows, kv_heads, slots, mask, some, some, 0.25, part)
    assert torch.equal(part[some], out[some])
    others = torch.ones(q.shape[0], dtype=torch.bool)
    others[some] = False
    assert bool((part[others] == 7.0).all())


def test_bf16_rows_are_read_exactly_and_rounded_to_nearest_even(lib):
    """bf16 in and out of the kernels (16 at a time on AVX-512, one at a time for the rest): the same attention over
    bf16 inputs, computed with fp32 inputs holding the same values, rounds to exactly torch's bf16 of its result."""
    q, k_rows, v_rows, kv_heads, slots, mask, _ = attention_case(torch.bfloat16, head_dim=24)  # 16 + a tail
    rows = torch.arange(q.shape[0])
    out, wide = torch.empty_like(q), torch.empty_like(q, dtype=torch.float32)
    ops.attention(lib, q, k_rows, v_rows, kv_heads, slots, mask, rows, rows, 0.25, out)
    ops.attention(lib, q.float(), k_rows.float(), v_rows.float(), kv_heads, slots, mask, rows, rows, 0.25, wide)
    assert torch.equal(out, wide.bfloat16())


def test_attention_refuses_unsupported_layouts(lib):
    q, k_rows, v_rows, kv_heads, slots, mask, _ = attention_case(torch.float32)
    rows = torch.arange(q.shape[0])
    with pytest.raises(ValueError, match="attention kernel"):
        ops.attention(lib, q, k_rows, v_rows, kv_heads, slots, mask, rows, rows, 0.25, torch.empty_like(q).half())
    with pytest.raises(ValueError, match="attention kernel"):
        ops.attention(lib, q, k_rows, v_rows, 4, slots, mask, rows, rows, 0.25, torch.empty_like(q))


def test_switched_off_or_without_a_compiler_torch_runs(monkeypatch, caplog):
    try:
        build.load.cache_clear()
        monkeypatch.setenv(build.ENV_SWITCH, "0")
        assert build.load() is None
        build.load.cache_clear()
        monkeypatch.delenv(build.ENV_SWITCH)
        monkeypatch.setattr(build, "compiler", lambda: None)
        with caplog.at_level(logging.WARNING, logger="specserve.engine"):
            assert build.load() is None
        assert "no C compiler" in caplog.text
    finally:
        build.load.cache_clear()


def test_a_failed_build_is_a_warning_not_an_error(monkeypatch, tmp_path, caplog):
    broken = tmp_path / "kernels.c"
    broken.write_text("this is not C\n")
    try:
        build.load.cache_clear()
        monkeypatch.setattr(build, "SOURCE", broken)
        monkeypatch.setenv("SPECSERVE_CACHE", str(tmp_path / "cache"))
        with caplog.at_level(logging.WARNING, logger="specserve.engine"):
            assert build.load() is None
        assert "could not build" in caplog.text
        assert not list((tmp_path / "cache").rglob("*.so*"))  # no half-written library left to load later
    finally:
        build.load.cache_clear()


def test_without_a_compiler_a_library_built_ahead_for_the_cpus_level_is_used(monkeypatch, tmp_path):
    cc = build.compiler()
    build.build(cc, tmp_path / build.prebuilt_name("x86-64-v3"), march="x86-64-v3")  # the Docker image's way
    (tmp_path / build.prebuilt_name("x86-64-v4").replace(".so", "-old.so")).write_text("a stale library's name")
    try:
        build.load.cache_clear()
        monkeypatch.setattr(build, "compiler", lambda: None)
        monkeypatch.setenv(build.ENV_PREBUILT, str(tmp_path))
        flags = set(build._cpu_flags().split())
        if not flags.issuperset(build.LEVELS["x86-64-v3"]):
            assert build.load() is None
            return
        prebuilt = build.load()
        assert prebuilt is not None and prebuilt.specserve_kernels_avx512() == 0  # the AVX2 build, not native
        packed, _, dense = q4_weights(32, 64)
        x = torch.randn(3, 64)
        assert torch.allclose(ops.q4_linear(prebuilt, x, *packed, None).double(), x.double() @ dense.T, atol=1e-5)
        codes, scales, weight = q8_weights(32, 64)  # the portable (non-AVX-512) code of the 8-bit product too
        assert torch.allclose(ops.q8_linear(prebuilt, x, *ops.pack_q8(codes, scales)).double(),
                              x.double() @ weight.double().T, atol=1e-5)
        dense = torch.randn(16, 64).bfloat16()
        assert torch.allclose(ops.bf16_linear(prebuilt, x, dense, None).double(),
                              x.bfloat16().double() @ dense.double().T, atol=1e-5)
    finally:
        build.load.cache_clear()


def test_bf16_linear_is_the_product_of_bf16_activations_row_by_row(lib):
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(40, 96, generator=g).bfloat16()
    bias = torch.randn(40, generator=g)
    x = torch.randn(7, 96, generator=g)
    y = ops.bf16_linear(lib, x, weight, bias)
    expected = x.bfloat16().double() @ weight.double().T + bias.double()  # the activations as a bf16 model has them
    assert torch.allclose(y.double(), expected, atol=1e-5)
    for r in range(7):
        assert torch.equal(ops.bf16_linear(lib, x[r:r + 1], weight, bias)[0], y[r])
    with pytest.raises(ValueError, match="bf16_linear"):
        ops.bf16_linear(lib, x, weight.float(), bias)


def test_a_level_is_forced_by_env_and_an_unknown_one_is_a_warning(monkeypatch, caplog):
    try:
        if "x86-64-v3" in LEVELS:
            build.load.cache_clear()
            monkeypatch.setenv(build.ENV_LEVEL, "x86-64-v3")
            forced = build.load()
            assert forced is not None and forced.specserve_kernels_avx512() == 0
        build.load.cache_clear()
        monkeypatch.setenv(build.ENV_LEVEL, "x86-64-v9")
        with caplog.at_level(logging.WARNING, logger="specserve.engine"):
            assert build.load() is None
        assert "SPECSERVE_CPU_LEVEL=x86-64-v9: not a level this CPU runs" in caplog.text
    finally:
        build.load.cache_clear()


def test_a_library_of_another_source_or_layout_is_refused(tmp_path):
    other = tmp_path / "kernels.c"
    other.write_text(build.SOURCE.read_text().replace(
        f"int specserve_kernels_version(void) {{ return {build.VERSION}; }}",
        f"int specserve_kernels_version(void) {{ return {build.VERSION + 1}; }}"))
    build.build(build.compiler(), tmp_path / "other.so", source=other)
    with pytest.raises(RuntimeError, match="not built from this kernels.c"):
        build.open_library(tmp_path / "other.so")
    moved = tmp_path / "moved.c"
    moved.write_text(build.SOURCE.read_text().replace("    int64_t qmax, length, n;\n} QueryGroupView;",
                                                      "    int64_t qmax, length, n, extra;\n} QueryGroupView;"))
    build.build(build.compiler(), tmp_path / "moved.so", source=moved)
    with pytest.raises(RuntimeError, match="QueryGroupView is 64 bytes there, 56 in ops.py"):
        build.open_library(tmp_path / "moved.so")
