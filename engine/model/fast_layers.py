"""Faster forwards for Llama-structured decoder layers whose projections run on the CPU kernels (int4 targets on
CPU: the demo's default), installed on the layer instances at load.

At one stream a 135M target's step was mostly per-operation overhead: HF's layer runs ~100 small torch ops per
layer (the norm alone is eight). Two forwards replace it:
- NativeLayer: the whole layer as one kernel call (kernels.c: specserve_llama_layer), fp32 inside, for forwards whose
  query groups are all short (decode, verification) and while nothing hooks o_proj / down_proj; and when no decoder
  layer is hooked either, NativeStack: every layer in one call (specserve_llama_stack);
- otherwise (a query group wider than NATIVE_QUERY, which the scheduler does not send where these layers run:
  prefill_chunk_limit; tensor parallelism's all-reduce hooks) an op-by-op lean forward: q/k/v
  fused into one int4 product and gate/up into another (packed weights concatenated by output blocks; the separate
  modules keep views of them, no second copy), the RMS norm as one fused op, HF's own rotary function and the
  engine's paged attention.
The layer is still called as a module, so hooks on it (the hidden-state taps of EAGLE-3, Medusa, DFlash) see its
output either way.

Outputs equal the HF layer's up to float rounding (tests/engine/test_cpu_kernels.py); the engine's exactness is with
respect to the model it runs, and every path computes a row independently of the other rows, so greedy speculative
output equals greedy plain output of the same engine."""

from __future__ import annotations

import ctypes
import sys
import types

import torch
import torch.nn.functional as F
from torch import nn

from specserve.engine.model.attention import PATTERN_ATTR, AttentionMetadata, paged_attention
from specserve.engine.model.cpu_kernels import ops as cpu_ops
from specserve.engine.model.hidden import decoder_layers
from specserve.engine.model.quantize import Int4Linear

# layer classes with exactly the Llama layer's structure: pre-norm attention and SwiGLU MLP, RMS norms, rotary
# embeddings applied by their module's apply_rotary_pos_emb, no q/k norms
LLAMA_LAYERS = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer"})
# query groups up to this wide run whole layers in one kernel call, prefill chunks included: against the op-by-op
# forward (SDPA), an int4 SmolLM2 prefill step measured 2.1-2.4x faster at 20-40 tokens, 1.7x at 80, ~1.0-1.15x at
# 160-320 (bf16; fp32 0.97-1.13x) and 0.89x at 384 (python -m bench.prefill_width; docs/benchmarks.md)
NATIVE_QUERY = 256
SILU = frozenset({"SiLU", "SiLUActivation"})  # torch's and transformers' (ACT2FN["silu"]) SiLU modules


class FusedInt4(nn.Module):
    """Several Int4Linear layers on the kernels that read the same input, as one product: their packed weights are
    concatenated by blocks of 16 outputs, and each original layer's buffers become views into the fused ones."""

    def __init__(self, layers: list[Int4Linear]):
        super().__init__()
        self.kernels = layers[0].kernels
        self.sizes = [m.out_features for m in layers]
        self.register_buffer("q4_codes", torch.cat([m.q4_codes for m in layers]))
        self.register_buffer("q4_scales", torch.cat([m.q4_scales for m in layers]))
        self.register_buffer("q4_minima", torch.cat([m.q4_minima for m in layers]))
        biases = [m.bias_bits if m.bias_bits is not None else
                  torch.zeros(m.out_features, dtype=torch.float32).view(torch.int32) for m in layers]
        has_bias = any(m.bias_bits is not None for m in layers)
        self.register_buffer("bias_bits", torch.cat(biases) if has_bias else None)
        start = 0
        for m in layers:  # the originals read the fused storage: no second copy of the weights
            blocks = m.out_features // cpu_ops.LANES
            for name in ("q4_codes", "q4_scales", "q4_minima"):
                setattr(m, name, getattr(self, name)[start:start + blocks])
            start += blocks

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        shape = x.shape
        y = cpu_ops.q4_linear(self.kernels, x.reshape(-1, shape[-1]), self.q4_codes, self.q4_scales, self.q4_minima,
                              self.bias_bits)
        return y.view(*shape[:-1], -1).split(self.sizes, dim=-1)


class FusedDense(nn.Module):
    """Several dense bf16 nn.Linear layers that read the same input, as one [sum N, K] weight; the originals'
    weights (and biases) become views into it (no second copy). The fp32 bias is what the kernel adds."""

    def __init__(self, layers: list[nn.Linear], kernels):
        super().__init__()
        self.kernels, self.sizes = kernels, [m.out_features for m in layers]
        self.weight = torch.cat([m.weight.detach() for m in layers]).contiguous()
        has_bias = any(m.bias is not None for m in layers)
        self.bias = torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features)
                               for m in layers]) if has_bias else None
        self.bias_f32 = None if self.bias is None else self.bias.float()
        start = 0
        for m in layers:
            end = start + m.out_features
            m.weight = nn.Parameter(self.weight[start:end], requires_grad=False)
            if m.bias is not None:
                m.bias = nn.Parameter(self.bias[start:end], requires_grad=False)
            start = end

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)


def _dense_bf16(*modules) -> bool:
    return all(type(m) is nn.Linear and m.weight.dtype == torch.bfloat16 and m.in_features % cpu_ops.GROUP == 0
               and m.weight.is_contiguous() for m in modules)


def _on_kernels(*modules) -> bool:
    return all(isinstance(m, Int4Linear) and m.kernels is not None and m.dense_from_rows is None for m in modules)


def fits(layer: nn.Module, kernels) -> int | None:
    """A Llama-structured layer with SiLU and RMS norms whose seven projections are int4 on the kernels (-> INT4)
    or dense bf16 with `kernels` given (-> DENSE_BF16); None otherwise."""
    if type(layer).__name__ not in LLAMA_LAYERS:
        return None
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    try:
        projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
    except AttributeError:
        return None
    if not (type(mlp.act_fn).__name__ in SILU and all(hasattr(n, "variance_epsilon") and n.weight.dim() == 1
                                                      for n in norms)
            and hasattr(sys.modules[type(layer).__module__], "apply_rotary_pos_emb")):
        return None
    if _on_kernels(*projections):
        return cpu_ops.INT4
    if kernels is not None and _dense_bf16(*projections):
        return cpu_ops.DENSE_BF16
    return None


def _rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    """HF's RMS norm (fp32 statistics, cast back before the weight) as one fused op."""
    return norm.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=norm.variance_epsilon).to(x.dtype)


class NativeLayer:
    """The whole layer as one kernel call (kernels.c: specserve_llama_layer: norm, fused q/k/v, rotary, K/V write,
    attention, o, residual, norm, fused gate/up, SiLU, down, residual; fp32 inside), used for forwards whose query
    groups are all at most NATIVE_QUERY wide (decode, verification, prefill chunks up to it) and while nothing hooks
    o_proj or down_proj (tensor parallelism's all-reduce does); otherwise the layer runs the op-by-op lean forward."""

    def __init__(self, layer: nn.Module, fused: dict, kind: int):
        attn, mlp = layer.self_attn, layer.mlp
        qkv, gate_up = fused["qkv"], fused["gate_up"]
        self.kernels, self.layer_idx, self.head_dim = qkv.kernels, attn.layer_idx, attn.head_dim
        self.dtype = layer.input_layernorm.weight.dtype
        self.kv_heads = qkv.sizes[1] // attn.head_dim
        self.hooked = (attn.o_proj, mlp.down_proj)
        self._keep = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight, qkv, gate_up,
                      attn.o_proj, mlp.down_proj)  # what the C struct points into

        def view(m):
            if kind == cpu_ops.DENSE_BF16:
                bias = getattr(m, "bias_f32", None) if isinstance(m, FusedDense) else \
                    (None if m.bias is None else m.bias.float())
                self._keep += (bias,)
                return cpu_ops.dense_weights(m.weight, bias)
            return cpu_ops.q4_weights(m.q4_codes, m.q4_scales, m.q4_minima, m.bias_bits)
        self.weights = cpu_ops.LayerWeights(
            layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
            layer.input_layernorm.variance_epsilon, layer.post_attention_layernorm.variance_epsilon, attn.scaling,
            cpu_ops.DTYPE_CODES[self.dtype], 0, kind, attn.o_proj.out_features, qkv.sizes[0] // attn.head_dim,
            self.kv_heads, attn.head_dim, mlp.down_proj.in_features, view(qkv), view(attn.o_proj), view(gate_up),
            view(mlp.down_proj))
        self._weights_ptr = ctypes.addressof(self.weights)

    def usable(self, hidden_states: torch.Tensor, md: AttentionMetadata | None, attention_mask) -> bool:
        return (md is not None and md.kernels is not None and attention_mask is None and not md.spare_row
                and hidden_states.dtype == self.dtype and hidden_states.shape[0] == 1
                and not any(m._forward_hooks or m._forward_pre_hooks for m in self.hooked))

    def forward_view(self, md: AttentionMetadata, pattern, cos: torch.Tensor, sin: torch.Tensor):
        """This forward's C view for `pattern` (built by the first layer that asks, shared by the rest), or None
        when a query group is wider than NATIVE_QUERY (a long prefill chunk: SDPA's job) or the rotary tables are not
        in the model dtype."""
        if pattern in md.native:
            return md.native[pattern]
        entry = None
        if all(g.query_index.shape[1] <= NATIVE_QUERY for g in md.groups) and cos.dtype == self.dtype:
            groups = []
            for g in md.groups:
                view = g.key_view(pattern)
                groups.append((view.slots.contiguous(), view.mask[:, 0].contiguous(), g.token_index.contiguous(),
                               g.output_index.contiguous()))
            keep = (groups, cos[0].contiguous(), sin[0].contiguous(), md.write_slots.contiguous())
            entry = (cpu_ops.forward_view(md.num_tokens, keep[1], keep[2], keep[3], groups), keep)
        md.native[pattern] = entry
        return entry

    def fits_pool(self, k_store: torch.Tensor) -> bool:
        return k_store.shape[2:] == (self.kv_heads, self.head_dim) and k_store.dtype in cpu_ops.DTYPE_CODES

    def run(self, md: AttentionMetadata, view, hidden_states: torch.Tensor) -> torch.Tensor | None:
        k_store, v_store = md.kv.key_store[self.layer_idx], md.kv.value_store[self.layer_idx]
        if not self.fits_pool(k_store):
            return None
        if self.layer_idx in md.layers_seen:
            raise NotImplementedError(f"layer {self.layer_idx}: attention runs more than once per forward")
        md.layers_seen.add(self.layer_idx)
        self.weights.kv_dtype = cpu_ops.DTYPE_CODES[k_store.dtype]
        x = hidden_states.contiguous()
        y = torch.empty_like(x)
        self.kernels.specserve_llama_layer(self._weights_ptr, ctypes.addressof(view[0]), k_store.data_ptr(),
                                           v_store.data_ptr(), x.data_ptr(), y.data_ptr())
        return y


class NativeStack:
    """Every decoder layer as NativeLayers in one kernel call (kernels.c: specserve_llama_stack): the interpreter's
    lock is released and taken back once per forward instead of once per layer (a server's event loop thread
    wants it in between), and no per-layer Python runs. Used by the first layer's forward when every layer could
    run natively and nothing hooks any layer (hidden-state taps need each layer's output); the other layers then
    pass its result through (STACK_DONE)."""

    def __init__(self, layers: list[nn.Module]):
        self.layers, self.natives = layers, [layer.specserve_native for layer in layers]
        self._weights = (ctypes.c_void_p * len(layers))(*[n._weights_ptr for n in self.natives])
        self._pools = (None, None, None)  # (the KV pool's stores, their K and V pointer arrays): built per pool

    def usable(self) -> bool:
        """The first layer's NativeLayer.usable held; nothing hooks any layer, nor any layer's o_proj / down_proj
        (NativeLayer.usable checks those of its own layer only)."""
        modules = [*self.layers, *(m for n in self.natives for m in n.hooked)]
        return (hasattr(self.natives[0].kernels, "specserve_llama_stack")  # (a bench may swap in an older library)
                and not any(m._forward_hooks or m._forward_pre_hooks for m in modules))

    def _pointers(self, md: AttentionMetadata):
        stores = (md.kv.key_store, md.kv.value_store, md.kv.key_store[self.natives[0].layer_idx].data_ptr())
        held = self._pools[0]
        if held is None or held[0] is not stores[0] or held[1] is not stores[1] or held[2] != stores[2]:
            ks = [md.kv.key_store[n.layer_idx] for n in self.natives]
            vs = [md.kv.value_store[n.layer_idx] for n in self.natives]
            if not all(n.fits_pool(k) for n, k in zip(self.natives, ks)):
                return None
            for n, k in zip(self.natives, ks):
                n.weights.kv_dtype = cpu_ops.DTYPE_CODES[k.dtype]
            self._pools = (stores, (ctypes.c_void_p * len(ks))(*[k.data_ptr() for k in ks]),
                           (ctypes.c_void_p * len(vs))(*[v.data_ptr() for v in vs]))
        return self._pools[1:]

    def run(self, md: AttentionMetadata, view, hidden_states: torch.Tensor) -> torch.Tensor | None:
        pointers = self._pointers(md)
        if pointers is None or any(n.layer_idx in md.layers_seen for n in self.natives):
            return None
        md.layers_seen.update(n.layer_idx for n in self.natives)
        x = hidden_states.contiguous()
        y = torch.empty_like(x)
        self.natives[0].kernels.specserve_llama_stack(ctypes.addressof(self._weights), len(self.natives),
                                                      ctypes.addressof(view[0]), ctypes.addressof(pointers[0]),
                                                      ctypes.addressof(pointers[1]), x.data_ptr(), y.data_ptr())
        md.native[STACK_DONE] = True
        return y


STACK_DONE = ("stack",)  # md.native's mark: this forward's layers all ran in the first layer's call


def _forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, cache=None, use_cache=False,
             position_embeddings=None, **kwargs) -> torch.Tensor:
    native, md = self.specserve_native, kwargs.get("specserve_metadata")
    if md is None:  # not an engine forward (training, a reference pass with another attention): HF's own layer
        return type(self).forward(self, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                  cache=cache, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
    if md.native.get(STACK_DONE):
        return hidden_states  # the first layer's call ran this one too: its input is the decoder's output
    if native.usable(hidden_states, md, attention_mask):
        view = native.forward_view(md, getattr(self.self_attn, PATTERN_ATTR, None), *position_embeddings)
        stack = self.specserve_stack
        out = None
        if view is not None and stack is not None and stack.layers[0] is self and stack.usable():
            out = stack.run(md, view, hidden_states)
        if out is None and view is not None:
            out = native.run(md, view, hidden_states)
        if out is not None:
            return out
    attn, fused = self.self_attn, self.specserve_fused
    batch, tokens, _ = hidden_states.shape
    q, k, v = fused["qkv"](_rms_norm(hidden_states, self.input_layernorm))
    head_dim = attn.head_dim
    q = q.view(batch, tokens, -1, head_dim).transpose(1, 2)
    k = k.view(batch, tokens, -1, head_dim).transpose(1, 2)
    v = v.view(batch, tokens, -1, head_dim).transpose(1, 2)
    cos, sin = position_embeddings
    q, k = fused["rotary"](q, k, cos, sin)
    out, _ = paged_attention(attn, q, k, v, attention_mask, scaling=attn.scaling, **kwargs)
    hidden_states = hidden_states + attn.o_proj(out.reshape(batch, tokens, -1))
    gate, up = fused["gate_up"](_rms_norm(hidden_states, self.post_attention_layernorm))
    return hidden_states + self.mlp.down_proj(F.silu(gate) * up)


def prefill_chunk_limit(model: nn.Module) -> int | None:
    """NATIVE_QUERY where the model's decoder layers run whole on the kernels, else None. The scheduler cuts prompts
    into chunks no wider, so every forward runs the same per-row arithmetic: a longer chunk would send its whole
    forward, batch-mates' decode rows included, down the op-by-op path (other rounding), and a row's logits would
    depend on what shares its step. Cost: on an AVX2 CPU (fp32) a 2.9k-token prompt's prefill took ~1.1x longer in
    chunks of 256 than in one of 2,048 op by op; on AVX-512 (bf16) the same (docs/benchmarks.md)."""
    try:
        layers = decoder_layers(model)
    except ValueError:
        return None
    return NATIVE_QUERY if layers and all(getattr(layer, "specserve_native", None) for layer in layers) else None


def speed_up_layers(model: nn.Module, kernels=None) -> int:
    """Install the faster forwards on every decoder layer that fits; -> how many. `kernels`: also dense bf16
    layers (int4 layers carry their own)."""
    try:
        layers = decoder_layers(model)
    except ValueError:
        return 0
    done = 0
    for layer in layers:
        kind = fits(layer, kernels)
        if kind is None:
            continue
        attn, mlp = layer.self_attn, layer.mlp
        if kind == cpu_ops.INT4:
            fused = {"qkv": FusedInt4([attn.q_proj, attn.k_proj, attn.v_proj]),
                     "gate_up": FusedInt4([mlp.gate_proj, mlp.up_proj])}
        else:
            fused = {"qkv": FusedDense([attn.q_proj, attn.k_proj, attn.v_proj], kernels),
                     "gate_up": FusedDense([mlp.gate_proj, mlp.up_proj], kernels)}
        layer.specserve_fused = fused | {"rotary": sys.modules[type(layer).__module__].apply_rotary_pos_emb}
        layer.specserve_native = NativeLayer(layer, layer.specserve_fused, kind)
        layer.forward = types.MethodType(_forward, layer)
        layer.specserve_stack = None
        done += 1
    patterns = {getattr(layer.self_attn, PATTERN_ATTR, None) for layer in layers}
    if done == len(layers) and len(patterns) == 1:  # one view serves every layer
        stack = NativeStack(list(layers))
        for layer in layers:
            layer.specserve_stack = stack
    return done
