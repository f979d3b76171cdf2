"""Tensor-level calls into the CPU kernels (kernels.c); `lib` is build.load()'s library. Inputs are checked here,
because a wrong shape or dtype in C is a wrong answer or a crash, not an exception."""

from __future__ import annotations

import ctypes

import torch

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
GROUP = 32


def supports(dtype: torch.dtype) -> bool:
    return dtype in DTYPE_CODES


MAX_GROUP = 16  # query heads per K/V head the attention kernel takes
LANES = 16  # outputs per block of the packed layout (one AVX-512 vector of fp32)


def pack_q4(codes: torch.Tensor, scales: torch.Tensor, minima: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """codes [N, K] in 0..15, scales / minima [N, K / 32] (w = code * scale + minimum) -> the kernel's layout: codes
    [N / 16, G, 16, 16] uint8 (block of 16 outputs, group, pair of inputs k, k + 1 as low / high nibble, output lane)
    and scales / minima [N / 16, G, 16] fp32; pure."""
    n, k = codes.shape
    pairs = codes.to(torch.int32).contiguous().view(torch.int64)  # [N, K / 2]: code k low, code k + 1 at bit 32
    bytes_ = ((pairs | (pairs >> 28)) & 0xFF).to(torch.uint8)  # k in bits 0-3, k + 1 in 4-7; pair p of g at g*16+p
    packed = bytes_.view(n // LANES, LANES, k // 2).transpose(1, 2).contiguous()  # [nb, G * 16, lane]
    packed = packed.view(n // LANES, k // GROUP, GROUP // 2, LANES)

    def lanes(t: torch.Tensor) -> torch.Tensor:
        return t.float().view(n // LANES, LANES, k // GROUP).transpose(1, 2).contiguous()  # [nb, g, lane]
    return packed, lanes(scales), lanes(minima)


def unpack_q4(packed: torch.Tensor, scales: torch.Tensor, minima: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pack_q4's inverse -> codes [N, K] int32, scales and minima [N, K / 32] fp32."""
    blocks, groups, pairs, _ = packed.shape
    c = torch.stack([packed & 15, packed >> 4], dim=-1)  # [nb, g, pair, lane, 2]
    codes = c.permute(0, 3, 1, 2, 4).reshape(blocks * LANES, groups * pairs * 2).to(torch.int32)

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(1, 2).reshape(blocks * LANES, groups)
    return codes, rows(scales), rows(minima)


def amx(lib: ctypes.CDLL) -> bool:
    """Whether this process runs int4 products of many bf16 rows on AMX tiles (build.load asks for them)."""
    return bool(lib.specserve_amx_on())


def packable(out_features: int, in_features: int) -> bool:
    return out_features % LANES == 0 and in_features % GROUP == 0


def q8_codes(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """[N, K] fp32 weights that are exactly code * scale in groups of 32 with codes in -127..127 and the group's
    largest |code| 127 (what GGUF's Q8_0 stores, dequantized) -> (codes [N, K] int8, scales [N, K / 32] fp32);
    None when the weights are not such a quantization (then nothing is lost by keeping them dense); pure."""
    n, k = weight.shape
    if k % GROUP or weight.dtype != torch.float32:
        return None
    w = weight.view(n, k // GROUP, GROUP)
    scales = w.abs().amax(dim=-1) / 127
    codes = torch.where(scales[..., None] > 0, w / scales[..., None].clamp(min=1e-38), 0).round()
    if codes.abs().max() > 127 or not torch.equal(codes * scales[..., None], w):
        return None
    return codes.to(torch.int8).view(n, k), scales


def pack_q8(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [N, K] int8, scales [N, K / 32] -> codes [N / 16, K, 16], scales [N / 16, G, 16] fp32; pure."""
    n, k = codes.shape
    packed = codes.view(n // LANES, LANES, k).transpose(1, 2).contiguous()
    return packed, scales.float().view(n // LANES, LANES, k // GROUP).transpose(1, 2).contiguous()


def q8_linear(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [R, K] (fp32 or bf16) -> [R, N] fp32 (scales may be held as int32 bits, as in q4_linear)."""
    x = x.contiguous()
    rows, k = x.shape
    blocks, kk, _ = packed.shape
    if kk != k or x.dtype not in DTYPE_CODES or scales.shape != (blocks, k // GROUP, LANES):
        raise ValueError(f"q8_linear: x {tuple(x.shape)} {x.dtype} does not fit weights [{blocks * LANES}, {kk}]")
    y = torch.empty(rows, blocks * LANES, dtype=torch.float32)
    lib.specserve_q8_linear(x.data_ptr(), DTYPE_CODES[x.dtype], rows, k, packed.data_ptr(), scales.data_ptr(),
                            blocks * LANES, y.data_ptr())
    return y


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def q4_linear(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, minima: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
    """x [R, K] (fp32 or bf16) -> [R, N] in x's dtype; packed, scales, minima from pack_q4; bias [N] fp32 or None.
    Scales, minima and bias may be held as int32 tensors of their fp32 bits (the kernel reads 4-byte floats)."""
    x = x.contiguous()
    rows, k = x.shape
    blocks, groups, pairs, _ = packed.shape
    n = blocks * LANES
    if (groups * pairs * 2 != k or scales.shape != (blocks, groups, LANES) or x.dtype not in DTYPE_CODES
            or any(t is not None and t.dtype not in (torch.float32, torch.int32) for t in (scales, minima, bias))):
        raise ValueError(f"q4_linear: x {tuple(x.shape)} {x.dtype} does not fit weights [{n}, {groups * pairs * 2}]")
    y = torch.empty(rows, n, dtype=x.dtype)
    lib.specserve_q4_linear(x.data_ptr(), DTYPE_CODES[x.dtype], rows, k, packed.data_ptr(), scales.data_ptr(),
                            minima.data_ptr(), _ptr(bias), n, y.data_ptr())
    return y


def q4_linear_bf16_products(lib: ctypes.CDLL, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                            minima: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [R, K] fp32 -> [R, N] fp32: what a bf16 model's int4 layer computes from x (rounded to bf16 inside), before
    its output is rounded; for tests and benches."""
    x = x.float().contiguous()
    blocks, groups, _, _ = packed.shape
    if x.shape[1] != groups * GROUP or scales.shape != (blocks, groups, LANES):
        raise ValueError(f"q4_linear_bf16_products: x {tuple(x.shape)} does not fit weights")
    y = torch.empty(x.shape[0], blocks * LANES, dtype=torch.float32)
    lib.specserve_q4_linear_bf16(x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(), scales.data_ptr(),
                                 minima.data_ptr(), _ptr(bias), blocks * LANES, y.data_ptr())
    return y


def attention(lib: ctypes.CDLL, q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, kv_heads: int,
              slots: torch.Tensor, mask: torch.Tensor, token_index: torch.Tensor, output_index: torch.Tensor,
              scale: float, out: torch.Tensor) -> None:
    """Write attention of q's rows `token_index` into the same rows of `out`.

    q and out [T, H, D] contiguous (fp32 or bf16, one dtype); k_rows / v_rows [slots, H_kv * D] (the pool, fp32 or
    bf16); slots [B, L] int64: the key slots of each sequence; mask [B, Qmax, L] bool: which of them each query slot
    sees; output_index [n]: each row's b * Qmax + j in the mask."""
    t, heads, head_dim = q.shape
    batch, length = slots.shape
    if (not q.is_contiguous() or not out.is_contiguous() or out.dtype != q.dtype or q.dtype not in DTYPE_CODES
            or k_rows.dtype not in DTYPE_CODES or v_rows.dtype != k_rows.dtype
            or k_rows.shape[1] != kv_heads * head_dim or not k_rows.is_contiguous() or not v_rows.is_contiguous()
            or mask.dtype != torch.bool or mask.shape[0] != batch or mask.shape[2] != length
            or heads % kv_heads or heads // kv_heads > MAX_GROUP):
        raise ValueError("attention kernel: unsupported layout or dtype")
    slots, mask = slots.contiguous(), mask.contiguous()
    token_index, output_index = token_index.contiguous(), output_index.contiguous()
    lib.specserve_attention(q.data_ptr(), DTYPE_CODES[q.dtype], heads, kv_heads, head_dim, k_rows.data_ptr(),
                            v_rows.data_ptr(), DTYPE_CODES[k_rows.dtype], slots.data_ptr(), mask.data_ptr(),
                            mask.shape[1], length, token_index.data_ptr(), output_index.data_ptr(),
                            token_index.shape[0], scale, out.data_ptr())


# ---- one Llama-structured decoder layer in one call (kernels.c: specserve_llama_layer) --------------------------

I64_, PTR_, F32_, I32_ = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int32


class Q4Weights(ctypes.Structure):
    _fields_ = [("codes", PTR_), ("scales", PTR_), ("minima", PTR_), ("bias", PTR_), ("K", I64_), ("N", I64_)]


class LayerWeights(ctypes.Structure):
    _fields_ = [("input_norm", PTR_), ("post_norm", PTR_), ("input_eps", F32_), ("post_eps", F32_), ("scale", F32_),
                ("dtype", I32_), ("kv_dtype", I32_), ("kind", I32_), ("hidden", I64_), ("heads", I64_), ("kv_heads", I64_),
                ("head_dim", I64_), ("intermediate", I64_), ("qkv", Q4Weights), ("o", Q4Weights),
                ("gate_up", Q4Weights), ("down", Q4Weights)]


class QueryGroupView(ctypes.Structure):
    _fields_ = [("slots", PTR_), ("token_index", PTR_), ("output_index", PTR_), ("mask", PTR_), ("qmax", I64_),
                ("length", I64_), ("n", I64_)]


class ForwardView(ctypes.Structure):
    _fields_ = [("tokens", I64_), ("cos", PTR_), ("sin", PTR_), ("write_slots", PTR_), ("groups", I64_),
                ("group", QueryGroupView * 2)]


INT4, DENSE_BF16 = 0, 1  # LayerWeights.kind


def dense_weights(weight: torch.Tensor, bias: torch.Tensor | None) -> Q4Weights:
    """The C view of a dense bf16 [N, K] weight (and fp32 bias), which must outlive it."""
    n, k = weight.shape
    return Q4Weights(weight.data_ptr(), None, None, _ptr(bias), k, n)


def bf16_linear(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [R, K] (fp32 or bf16, rounded to bf16) -> [R, N] fp32 with weight [N, K] bf16, bias [N] fp32 or None."""
    x, rows = x.contiguous(), x.shape[0]
    n, k = weight.shape
    if (weight.dtype != torch.bfloat16 or not weight.is_contiguous() or x.shape[1] != k or k % GROUP
            or x.dtype not in DTYPE_CODES):
        raise ValueError(f"bf16_linear: x {tuple(x.shape)} {x.dtype} does not fit weights {tuple(weight.shape)}")
    y = torch.empty(rows, n, dtype=torch.float32)
    lib.specserve_bf16_linear(x.data_ptr(), DTYPE_CODES[x.dtype], rows, k, weight.data_ptr(), _ptr(bias), n,
                              y.data_ptr())
    return y


def q4_weights(codes: torch.Tensor, scales: torch.Tensor, minima: torch.Tensor, bias: torch.Tensor | None
               ) -> Q4Weights:
    """The C view of pack_q4's tensors (which must outlive it)."""
    blocks, groups, pairs, _ = codes.shape
    return Q4Weights(codes.data_ptr(), scales.data_ptr(), minima.data_ptr(), _ptr(bias), groups * pairs * 2,
                     blocks * LANES)


def forward_view(tokens: int, cos: torch.Tensor, sin: torch.Tensor, write_slots: torch.Tensor,
                 groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]) -> ForwardView:
    """groups: (slots [B, L] int64, mask [B, Qmax, L] bool, token_index, output_index), all contiguous and kept
    alive by the caller while the view is used; at most two (the forward's short and long query groups)."""
    view = ForwardView(tokens, cos.data_ptr(), sin.data_ptr(), write_slots.data_ptr(), len(groups))
    for i, (slots, mask, token_index, output_index) in enumerate(groups):
        view.group[i] = QueryGroupView(slots.data_ptr(), token_index.data_ptr(), output_index.data_ptr(),
                                       mask.data_ptr(), mask.shape[1], mask.shape[2], token_index.shape[0])
    return view
