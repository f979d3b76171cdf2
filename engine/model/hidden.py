"""Hidden states of chosen target layers, captured during the ordinary target forward by forward hooks (no
`output_hidden_states` for every layer, no second pass) at the token rows a step asks for.

Layer ids: 0 .. L-1 are the outputs of the decoder layers (HF's `hidden_states[i + 1]`); -1 is the final norm's
output, the state the LM head reads (what Medusa heads take).
"""

from __future__ import annotations

import torch

FINAL = -1
_NORM_NAMES = ("norm", "ln_f", "final_layernorm", "norm_f", "final_layer_norm")


def decoder_layers(model) -> torch.nn.ModuleList:
    """The model's stack of decoder layers: the first ModuleList with num_hidden_layers entries."""
    n = model.config.num_hidden_layers
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == n:
            return module
    raise ValueError(f"{type(model).__name__}: no list of {n} decoder layers found for hidden-state capture")


def final_norm(model) -> torch.nn.Module:
    base = model.base_model
    for name in _NORM_NAMES:
        module = getattr(base, name, None)
        if isinstance(module, torch.nn.Module):
            return module
    raise ValueError(f"{type(model).__name__}: no final norm found ({', '.join(_NORM_NAMES)}) for hidden layer -1")


class LayerTaps:
    """Forward hooks on the requested layers; they copy rows only between `begin()` and `end()` (one forward)."""

    def __init__(self, model, layers: tuple[int, ...]):
        self.layers = tuple(sorted(set(layers)))
        stack = decoder_layers(model) if any(i != FINAL for i in self.layers) else None
        self._rows: torch.Tensor | None = None
        self._out: dict[int, torch.Tensor] | None = None
        for i in self.layers:
            if i != FINAL and not 0 <= i < len(stack):
                raise ValueError(f"hidden layer {i}: the target has {len(stack)} layers (ids 0..{len(stack) - 1}, "
                                 "or -1 for the final norm)")
            module = final_norm(model) if i == FINAL else stack[i]
            module.register_forward_hook(self._hook(i))

    def _hook(self, layer: int):
        def hook(module, args, output):
            if self._out is None:
                return
            hidden = output[0] if isinstance(output, tuple) else output  # [1, T, H]
            hidden = hidden[0]
            self._out[layer] = hidden if self._rows is None else hidden.index_select(0, self._rows)
        return hook

    def begin(self, rows: torch.Tensor | None) -> None:
        """Capture the next forward at token rows `rows` [R] (None: every token)."""
        self._rows, self._out = rows, {}

    def end(self, check: bool = True) -> dict[int, torch.Tensor]:
        """layer id -> [R, H] of the forward since begin()."""
        out, self._rows, self._out = self._out or {}, None, None
        missing = [i for i in self.layers if i not in out]
        if missing and check:
            raise RuntimeError(f"hidden layers {missing} were not reached by the forward")
        return out
