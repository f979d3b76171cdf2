"""A Llama-family causal LM's whole forward without transformers' model code around it, for steps the one-call
decoder (fast_layers.NativeStack) runs: embedding, rotary tables, the decoder in one kernel call, final norm, the head
on the rows wanted. The same modules in the same order as LlamaForCausalLM.forward (Mistral's and Qwen2's compute the
same), so the same logits bit for bit; what it leaves out is the per-call glue (decorators, output records, mask
creation, 30 layers' pass-through calls): ~1.4 ms of a 12.6 ms 4-stream int4 step on a 2-core Xeon before it.
Measured: python -m bench.cpu_kernels --against transformers (docs/benchmarks.md, issue 34)."""

from __future__ import annotations

import torch

from specserve.engine.model.attention import PATTERN_ATTR, AttentionMetadata
from specserve.engine.model.fast_layers import NATIVE_QUERY, NativeStack, _forward
from specserve.engine.model.hidden import decoder_layers

# causal LM -> its base model, whose forward is embed -> rotary -> layers -> norm (-> the head on kept rows); the masks
# Qwen2's and Mistral's forwards also build are None under the engine's attention (it refuses any other), and their
# windows travel in the layers' attention patterns, which the kernels' view applies
MODELS = {"LlamaForCausalLM": "LlamaModel", "MistralForCausalLM": "MistralModel", "Qwen2ForCausalLM": "Qwen2Model"}


class NativeForward:
    """Built for a model whose every layer is in one NativeStack (`of`); `forward` -> logits, or None when this
    forward is not one for the stack (a long query group, a hook on the model, a layer whose forward is not
    the engine's) and transformers' forward must run."""

    def __init__(self, model, stack: NativeStack):
        self.model, self.stack, self.layers = model, stack, stack.layers
        self.pattern = getattr(self.layers[0].self_attn, PATTERN_ATTR, None)

    @staticmethod
    def of(model) -> NativeForward | None:
        if MODELS.get(type(model).__name__) != type(getattr(model, "model", None)).__name__:
            return None
        try:
            layers = decoder_layers(model)
        except ValueError:
            return None
        stack = getattr(layers[0], "specserve_stack", None)
        if stack is None or list(stack.layers) != list(layers) or len(layers) != model.config.num_hidden_layers:
            return None
        return NativeForward(model, stack)

    def _modules(self) -> tuple | None:
        """(embedding, rotary tables, final norm, head) as the model holds them now (a Q8 head may replace the
        head after loading; they are called as modules, so their own hooks run), or None when something hooks the
        model or its base model (which this forward does not call) or the stack's path."""
        model = self.model
        base = model.model
        if (model._forward_hooks or model._forward_pre_hooks or base._forward_hooks or base._forward_pre_hooks
                or not all(getattr(layer.forward, "__func__", None) is _forward for layer in self.layers)
                or not self.stack.usable()):
            return None
        return base.embed_tokens, base.rotary_emb, base.norm, model.lm_head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                logits_index: torch.Tensor) -> torch.Tensor | None:
        """input_ids, positions [T], logits_index [N] -> logits [N, V] as transformers' forward returns them."""
        if md.kernels is None or not all(g.query_index.shape[1] <= NATIVE_QUERY for g in md.groups):
            return None  # a long prefill chunk: the layers' op-by-op forwards (SDPA)
        modules = self._modules()
        if modules is None:
            return None
        embed, rotary, norm, head = modules
        hidden = embed(input_ids[None])
        native = self.layers[0].specserve_native
        if not native.usable(hidden, md, None):
            return None
        view = native.forward_view(md, self.pattern, *rotary(hidden, position_ids=positions[None]))
        out = None if view is None else self.stack.run(md, view, hidden)
        if out is None:
            return None
        return head(norm(out)[:, logits_index, :])[0]

