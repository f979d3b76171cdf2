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
    def __init__(self, linear: nn.Linear, dtype: torch.dtype, group: int = INT4_GROUP):
        super().__init__()
        codes, scales, low = int4_codes(linear.weight, group)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))
        zeros = low + 8 * scales  # the kernel dequantizes (q - 8) * scale + zero
        self.register_buffer("scales_and_zeros", torch.stack([scales, zeros], dim=-1).transpose(0, 1)
                             .contiguous().to(dtype))  # [K / group, N, 2]
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(dtype))
        self.group, self.in_features, self.out_features = group, linear.in_features, linear.out_features
        self._codes = codes  # kept until keep_dense() has run or been declined (quantize_linears drops it)

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scales_and_zeros)

    def dequantized(self) -> torch.Tensor:
        """(q - 8) * scale + zero with the stored (dtype-rounded) scales and zeros: what the kernel applies."""
        scales, zeros = self.scales_and_zeros.float().transpose(0, 1).unbind(-1)  # [N, K / group] each
        n, k = self._codes.shape
        q = self._codes.float().view(n, k // self.group, self.group)
        return ((q - 8) * scales[..., None] + zeros[..., None]).view(n, k)


def quantizable(linear: nn.Linear, mode: str) -> bool:
    """int4 packs whole groups of input features and output rows in eights."""
    if mode == "int4":
        return linear.in_features % INT4_GROUP == 0 and linear.out_features % 8 == 0
    return True


def quantize_linears(model: nn.Module, mode: str, dtype: torch.dtype, skip: tuple[str, ...] = ("lm_head",),
                     dense_from_rows: int = 0) -> int:
    """Replace the model's nn.Linear layers (except those named in `skip`) in place; -> how many were replaced.
    Weights are read in fp32 (load the model in fp32 first, then cast the rest to `dtype`). `dense_from_rows` > 0:
    each layer also keeps its dequantized weight in `dtype` for forwards of at least that many rows."""
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization: {mode!r} is not one of {', '.join(QUANTIZATIONS)}")
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and name not in skip and quantizable(child, mode):
                q = Int8Linear(child, dtype) if mode == "int8" else Int4Linear(child, dtype)
                if dense_from_rows > 0:
                    q.keep_dense(dense_from_rows, dtype)
                q.__dict__.pop("_codes", None)
                setattr(parent, name, q.to(child.weight.device))
                replaced += 1
    return replaced
