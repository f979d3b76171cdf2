"""Weight-only quantized linear layers (`--quantization int8|int4`, vLLM's flag name), on torch's packed CPU kernels.

- int8: per-output-channel symmetric scales, `aten._weight_int8pack_mm` (activations in bf16/fp16/fp32).
- int4: groups of `INT4_GROUP` input features with a scale and a minimum each (asymmetric, codes 0..15),
  `aten._weight_int4pack_mm_for_cpu` on weights packed by `aten._convert_weight_to_int4pack_for_cpu`. The kernel's
  convention is w = (q - 8) * scale + zero, so zero = minimum + 8 * scale.

A GGUF file's Q4_1 tensors are groups of 32 with a scale d and a minimum m, whose codes span 0..15 in every block
llama.cpp writes (d = (max - min) / 15): re-quantizing the dequantized weights by group min/max recovers the file's
codes, d and m exactly (up to the rounding of d and m to the activations' dtype), so `int4` on a Q4_1 GGUF runs the
file's own 4-bit model instead of a bf16 copy of it.

Every `nn.Linear` of the decoder is replaced except the output head (`lm_head`), which stays in the model's dtype:
it is usually tied to the input embeddings (a gather), and the speculative methods read its weight.
Losslessness is with respect to the quantized model: speculative output equals plain output of the same quantized
weights (tests/engine/test_quantization.py).
"""

from __future__ import annotations

import torch
from torch import nn

from specserve.config.schema import QUANTIZATIONS
from specserve.engine.model.cpu_kernels import ops as cpu_ops

INT4_GROUP = 32


class PackedLinear(nn.Module):
    """A linear layer whose weight lives in a packed kernel's format: each subclass sets `out_features` and `bias`,
    defines `_mm(x)`, its kernel on a 2-D activation, and `dequantized()`, the weight its kernel applies.

    The packed kernels are matrix-vector kernels whose time grows linearly with the rows (bench.quant_kernels: int4
    0.53-0.66x a dense bf16 matmul up to 8 rows, even at 16, 1.3-2x slower from 32 rows), so a layer may also keep
    its dequantized weight dense (`keep_dense(rows)`) and run it for a forward of at least `rows` rows: wide verify
    and batched steps then cost what the dtype's model costs, at the memory of both copies."""

    dense_from_rows: int | None = None

    def keep_dense(self, rows: int, dtype: torch.dtype) -> None:
        self.register_buffer("dense_weight", self.dequantized().to(dtype))
        self.dense_from_rows = rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if self.dense_from_rows is not None and x.shape[0] >= self.dense_from_rows:
            y = nn.functional.linear(x, self.dense_weight.to(x.dtype))
        else:
            y = self._mm(x.contiguous())
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)


class Int8Linear(PackedLinear):
    def __init__(self, linear: nn.Linear, dtype: torch.dtype):
        super().__init__()
        w = linear.weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
        self.register_buffer("qweight", (w / scales[:, None]).round().clamp(-128, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(dtype))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(dtype))
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]


def int4_codes(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (codes [N, K] int32 in 0..15, scales [N, K / group], minima [N, K / group]); pure."""
    n, k = weight.shape
    w = weight.detach().float().view(n, k // group, group)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scales = ((high - low) / 15).clamp(min=1e-12)
    codes = ((w - low[..., None]) / scales[..., None]).round().clamp(0, 15).to(torch.int32)
    return codes.view(n, k), scales, low


class Int4Linear(PackedLinear):
    """With `kernels` (engine/model/cpu_kernels, when they fit: groups of 32, outputs in sixteens, fp32 or bf16
    activations) the weights are kept in their kernel's layout, w = code * scale + minimum with fp32 scales and
    minima (the file's own values for a Q4_1 GGUF); otherwise in torch's int4 format, whose scales and zeros are
    rounded to the activations' dtype."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype, group: int = INT4_GROUP, kernels=None):
        super().__init__()
        codes, scales, low = int4_codes(linear.weight, group)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(dtype))
        self.group, self.in_features, self.out_features = group, linear.in_features, linear.out_features
        self._codes = codes  # kept until keep_dense() has run or been declined (quantize_linears drops it)
        self.kernels = None
        if kernels is not None and group == cpu_ops.GROUP and cpu_ops.supports(dtype) and \
                cpu_ops.packable(self.out_features, self.in_features):
            self.kernels = kernels
            packed, lane_scales, lane_minima = cpu_ops.pack_q4(codes, scales, low)
            # fp32 values kept as their int32 bits: `model.to(bf16)` casts floating buffers, and the kernel reads fp32
            self.register_buffer("q4_codes", packed)
            self.register_buffer("q4_scales", lane_scales.view(torch.int32))
            self.register_buffer("q4_minima", lane_minima.view(torch.int32))
            self.register_buffer("bias_bits", None if linear.bias is None else
                                 linear.bias.detach().float().contiguous().view(torch.int32))
            return
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        zeros = low + 8 * scales  # the kernel dequantizes (q - 8) * scale + zero
        self.register_buffer("scales_and_zeros", torch.stack([scales, zeros], dim=-1).transpose(0, 1)
                             .contiguous().to(dtype))  # [K / group, N, 2]

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return cpu_ops.q4_linear(self.kernels, x, self.q4_codes, self.q4_scales, self.q4_minima, None)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scales_and_zeros)

    def dequantized(self) -> torch.Tensor:
        """The weight the kernel applies: code * scale + minimum (fp32) with the kernels, else (q - 8) * scale +
        zero with the stored (dtype-rounded) scales and zeros."""
        if self.kernels is not None:
            codes, scales, minima = cpu_ops.unpack_q4(self.q4_codes, self.q4_scales.view(torch.float32),
                                                      self.q4_minima.view(torch.float32))
            n, k = codes.shape
            w = codes.float().view(n, k // self.group, self.group) * scales[..., None] + minima[..., None]
            return w.view(n, k)
        scales, zeros = self.scales_and_zeros.float().transpose(0, 1).unbind(-1)  # [N, K / group] each
        n, k = self._codes.shape
        q = self._codes.float().view(n, k // self.group, self.group)
        return ((q - 8) * scales[..., None] + zeros[..., None]).view(n, k)


class Q8Head(nn.Module):
    """An output head whose weights are exactly 8-bit codes times a scale per group of 32 (a GGUF file's Q8_0
    `token_embd`/`output`, which transformers dequantizes), run on the CPU kernels' 8-bit matrix-vector product: the
    file's own head, in fp32 arithmetic, reading a quarter of the fp32 bytes (half of bf16's). An fp32 model computes
    every forward on it (`max_rows` None): faster than the fp32 matmul at every row count measured (1-64 rows, AVX2
    and AVX-512), and a row's logits then never depend on its batch-mates. A bf16 model computes forwards of up to
    `max_rows` rows on it (decode, verification at one stream), where the product is bound by reading the weights;
    more rows go to the dense weight in the model's dtype (`weight`, which the speculative methods read too), where
    bf16's native matmul is 2-3x faster from 32 rows. There a row's logits come from one of two products depending on
    the rows in its step, and near-ties may differ with the batch, as the README says for bf16 in general."""

    def __init__(self, head: nn.Linear, codes: torch.Tensor, scales: torch.Tensor, kernels, max_rows: int | None):
        super().__init__()
        self.weight = head.weight  # the dense head (tied to the input embeddings where the model ties them)
        packed, lane_scales = cpu_ops.pack_q8(codes, scales)
        self.register_buffer("q8_codes", packed)
        self.register_buffer("q8_scales", lane_scales.view(torch.int32))  # fp32 bits: see Int4Linear
        self.kernels, self.max_rows = kernels, max_rows
        self.in_features, self.out_features = head.in_features, head.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if (self.max_rows is not None and x.shape[0] > self.max_rows) or x.dtype not in cpu_ops.DTYPE_CODES:
            y = nn.functional.linear(x, self.weight)
        else:
            y = cpu_ops.q8_linear(self.kernels, x, self.q8_codes, self.q8_scales)  # fp32 logits
        return y.view(*shape[:-1], self.out_features)


Q8_HEAD_MAX_ROWS = 8


def keep_q8_head(model: nn.Module, kernels, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Give `model` (to run in `dtype`) a Q8Head if its output head (fp32 weights, as loaded for quantization) is
    exactly 8-bit groups; -> whether it did."""
    max_rows = None if dtype == torch.float32 else Q8_HEAD_MAX_ROWS
    head = model.get_output_embeddings()
    if kernels is None or type(head) is not nn.Linear or head.bias is not None or \
            not cpu_ops.packable(head.out_features, head.in_features):
        return False
    found = cpu_ops.q8_codes(head.weight.detach())
    if found is None:
        return False
    model.set_output_embeddings(Q8Head(head, *found, kernels, max_rows))
    return True


def quantizable(linear: nn.Linear, mode: str) -> bool:
    """int4 packs whole groups of input features and output rows in eights."""
    if mode == "int4":
        return linear.in_features % INT4_GROUP == 0 and linear.out_features % 8 == 0
    return True


def quantize_linears(model: nn.Module, mode: str, dtype: torch.dtype, skip: tuple[str, ...] = ("lm_head",),
                     dense_from_rows: int = 0, kernels=None) -> int:
    """Replace the model's nn.Linear layers (except those named in `skip`) in place; -> how many were replaced.
    Weights are read in fp32 (load the model in fp32 first, then cast the rest to `dtype`). `dense_from_rows` > 0:
    each layer also keeps its dequantized weight in `dtype` for forwards of at least that many rows. `kernels`
    (engine/model/cpu_kernels): int4 layers run on them where they fit."""
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization: {mode!r} is not one of {', '.join(QUANTIZATIONS)}")
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and name not in skip and quantizable(child, mode):
                q = Int8Linear(child, dtype) if mode == "int8" else Int4Linear(child, dtype, kernels=kernels)
                if dense_from_rows > 0:
                    q.keep_dense(dense_from_rows, dtype)
                q.__dict__.pop("_codes", None)
                setattr(parent, name, q.to(child.weight.device))
                replaced += 1
    return replaced
