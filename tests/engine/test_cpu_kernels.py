"""The engine on the CPU kernels: which parts run on them, that the lean layer computes HF's layer, and exactness
(greedy speculative = greedy plain, chains and token trees) on an int4 target whose every projection, attention and
layer runs on them."""

import pytest
import torch

from specserve.engine.model.attention import SHORT_QUERY, SeqChunk
from specserve.engine.model.cpu_kernels import build
from specserve.engine.model.fast_layers import FusedDense, FusedInt4, NativeLayer, NativeStack
from specserve.engine.model.hidden import decoder_layers
from specserve.engine.model.native_forward import NativeForward
from specserve.engine.model.quantize import Int4Linear
from specserve.engine.sampling_params import SamplingParams
from tests.engine.helpers import make_core, run
from tests.engine.test_greedy_exactness import PROMPTS
from tests.engine.test_quantization import GREEDY

pytestmark = pytest.mark.skipif(build.load() is None, reason="no C compiler to build the CPU kernels")


def test_an_int4_llama_runs_its_layers_projections_and_attention_on_the_kernels(tiny):
    core = make_core(tiny["llama"], quantization="int4")
    model = core.target.model
    assert core.target.kernels is not None
    assert all(m.kernels is not None for m in model.modules() if isinstance(m, Int4Linear))
    layers = decoder_layers(model)
    assert all("forward" in vars(layer) for layer in layers)  # the lean forward, on the instance
    qkv = layers[0].specserve_fused["qkv"]
    assert isinstance(qkv, FusedInt4) and qkv.sizes == [64, 32, 32]
    # the separate projections read the fused storage (no second copy) and compute what the fused one does
    q_proj = layers[0].self_attn.q_proj
    assert q_proj.q4_codes.data_ptr() == qkv.q4_codes.data_ptr()
    x = torch.randn(3, 64)
    assert torch.equal(qkv(x)[0], q_proj(x)) and torch.equal(qkv(x)[2], layers[0].self_attn.v_proj(x))


def three_forwards(core, monkeypatch, first: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits of a prefill chunk of `first` then 3 decode/verify rows on its K/V, computed with the whole layer in one
    kernel call, with the op-by-op lean forward, and with HF's own forward (same modules and kernels)."""
    runner = core.target
    ids = torch.randint(1, 50, (first + 3,), generator=torch.Generator().manual_seed(first))
    table = core.allocator.allocate(core.allocator.blocks_for(len(ids)))
    chunks = [SeqChunk(block_table=table, start=0, num_new=first), SeqChunk(block_table=table, start=first, num_new=3)]
    rows = torch.arange(len(ids))

    def both_calls():
        return torch.cat([runner.forward(ids[:first], chunks[:1], rows[:first]),
                          runner.forward(ids[first:], chunks[1:], rows[:3])])
    calls, stacks, direct = [], [], []
    run_native, run_stack, run_direct = NativeLayer.run, NativeStack.run, NativeForward.forward
    layers = len(decoder_layers(runner.model))

    def counted(self, *args):
        out = run_direct(self, *args)
        direct.append(out is not None)
        return out
    with monkeypatch.context() as patch:
        patch.setattr(NativeLayer, "run", lambda self, *a: calls.append(1) or run_native(self, *a))
        patch.setattr(NativeStack, "run", lambda self, *a: stacks.append(1) or run_stack(self, *a))
        patch.setattr(NativeForward, "forward", counted)
        fused = both_calls()
        assert stacks == [1, 1] and not calls  # each forward's layers ran in one call, the whole decoder
        assert direct == [True, True]  # ... without transformers' model code around it
        patch.setattr(runner, "native", None)
        assert torch.equal(both_calls(), fused)  # transformers' forward around the same call: the same logits
        assert stacks == [1, 1, 1, 1] and direct == [True, True]
        patch.setattr(NativeStack, "usable", lambda self: False)
        per_layer = both_calls()
        assert len(calls) == 2 * layers  # every layer of both forwards ran as one call
        assert torch.equal(per_layer, fused)  # the same kernel, layer after layer
        patch.setattr(NativeLayer, "usable", lambda self, *a: False)
        lean = both_calls()
    for layer in decoder_layers(runner.model):  # back to HF's forward (the class's)
        del layer.forward
    with monkeypatch.context() as patch:
        patch.setattr(NativeForward, "forward", counted)
        hf = both_calls()
    assert direct == [True, True, False, False]  # layers without the engine's forward: no direct path either
    assert not torch.equal(hf, torch.zeros_like(hf))
    return fused, lean, hf


@pytest.mark.parametrize("first", [5, SHORT_QUERY + 20])  # a prefill chunk in the short group, one past it
def test_the_fused_and_lean_layers_compute_the_hf_layer(tiny, monkeypatch, first, kernel_level):
    fused, lean, hf = three_forwards(make_core(tiny["llama"], quantization="int4"), monkeypatch, first)
    assert torch.allclose(lean, hf, atol=1e-5, rtol=1e-5)
    assert torch.allclose(fused, hf, atol=1e-4, rtol=1e-4)


def test_an_int4_bf16_llama_on_the_kernels_computes_the_hf_layer(tiny, monkeypatch):
    """bf16 activations: the products round them to bf16 (on AMX tiles from AMX_MIN_ROWS rows where the CPU has
    them: the 9-row prefill below; multiply-adds for the 3 decode rows)."""
    core = make_core(tiny["llama"], quantization="int4", dtype="bfloat16")
    assert isinstance(decoder_layers(core.target.model)[0].specserve_fused["qkv"], FusedInt4)
    fused, lean, hf = three_forwards(core, monkeypatch, first=9)
    scale = hf.abs().max().item()
    assert (fused - hf).abs().max().item() < 0.05 * scale  # bf16: HF rounds after every op, the kernel once a layer
    assert (lean - hf).abs().max().item() < 0.05 * scale
    assert len(run(core, PROMPTS[:2], GREEDY)[0].output_token_ids) == GREEDY.max_tokens


def test_a_bf16_llama_runs_its_dense_layers_fused(tiny, monkeypatch):
    core = make_core(tiny["llama"], dtype="bfloat16")
    layers = decoder_layers(core.target.model)
    qkv = layers[0].specserve_fused["qkv"]
    assert isinstance(qkv, FusedDense) and qkv.weight.dtype == torch.bfloat16
    assert layers[0].self_attn.k_proj.weight.data_ptr() == qkv.weight[64:].data_ptr()  # views, no second copy
    fused, lean, hf = three_forwards(core, monkeypatch)
    scale = hf.abs().max().item()
    assert (fused - hf).abs().max().item() < 0.05 * scale  # bf16: HF rounds after every op, the kernel once a layer
    assert (lean - hf).abs().max().item() < 0.05 * scale
    assert len(run(core, PROMPTS[:2], GREEDY)[0].output_token_ids) == GREEDY.max_tokens


def test_speculation_is_exact_on_the_kernels_with_chains_and_trees(tiny, monkeypatch, kernel_level):
    """fp32: every decode and verify forward runs the decoder as one kernel call, without transformers' model code
    (trees through their query groups' masks)."""
    expected = [o.output_token_ids for o in run(make_core(tiny["llama"], quantization="int4"), PROMPTS, GREEDY)]
    direct = NativeForward.forward
    for kw in (dict(speculative_method="ngram", k=6, prompt_lookup_min=1, prompt_lookup_branches=3,
                    max_num_batched_tokens=24),
               dict(draft=tiny["llama_draft"], k=3)):
        core = make_core(tiny["llama"], quantization="int4", **kw)
        ran = []
        with monkeypatch.context() as patch:
            patch.setattr(NativeForward, "forward", lambda self, *a: (lambda out: ran.append(out is not None) or out)(
                direct(self, *a)))
            outs = run(core, PROMPTS, GREEDY, join_after=3, join_from=5)
        assert [o.output_token_ids for o in outs] == expected
        assert sum(o.speculation.num_accepted_tokens for o in outs) > 0
        assert any(ran)  # token trees (n-gram branches) / chains (the draft model's) took the direct path


def test_bf16_int4_speculation_keeps_plain_greedy_output_on_the_kernels(tiny, kernel_level):
    """bf16: an int4 product's rows come out bit for bit the same at any row count (AMX tiles from AMX_MIN_ROWS rows
    where the CPU has them, their twin on multiply-adds below), so greedy speculation with wide verify forwards
    (chains of 6: 7 rows a sequence) still emits plain decoding's tokens."""
    expected = [o.output_token_ids for o in run(make_core(tiny["llama"], quantization="int4", dtype="bfloat16"),
                                                PROMPTS, GREEDY)]
    core = make_core(tiny["llama"], quantization="int4", dtype="bfloat16", speculative_method="ngram", k=6,
                     prompt_lookup_min=1)
    outs = run(core, PROMPTS, GREEDY, join_after=3, join_from=5)
    assert [o.output_token_ids for o in outs] == expected
    assert sum(o.speculation.num_accepted_tokens for o in outs) > 0


def test_switched_off_the_engine_runs_torch_kernels(tiny, monkeypatch):
    build.load.cache_clear()
    try:
        monkeypatch.setenv(build.ENV_SWITCH, "0")
        core = make_core(tiny["llama"], quantization="int4")
        assert core.target.kernels is None
        assert all(m.kernels is None and hasattr(m, "packed") for m in core.target.model.modules()
                   if isinstance(m, Int4Linear))
        assert not any("forward" in vars(layer) for layer in decoder_layers(core.target.model))
        assert len(run(core, PROMPTS[:2], GREEDY)[0].output_token_ids) == GREEDY.max_tokens
    finally:
        build.load.cache_clear()


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_qwen2_and_mistral_layers_run_fused_and_stay_exact(tmp_path, family, monkeypatch):
    """q/k/v biases (Qwen2) and sliding-window layers (both: their masks) through the fused layer: the model as its
    own draft, greedy, equals plain decoding and has every drafted token accepted (broken K/V in the target's pool
    or the draft's would show as a rejection, which greedy identity alone cannot see). Mistral's layers all share
    one window, so its decoder runs in one call without transformers' model code (the direct forward, through the
    query groups' window masks): the same tokens as transformers' forward around the same call."""
    from tests.tiny_families import prompts, save_family

    path = save_family(family, tmp_path)
    plain = make_core(path, quantization="int4", block_size=4)
    assert all("forward" in vars(layer) for layer in decoder_layers(plain.target.model))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    direct, run_direct = [], NativeForward.forward
    monkeypatch.setattr(NativeForward, "forward", lambda self, *a: (lambda out: direct.append(out is not None) or out)(
        run_direct(self, *a)))
    expected = [o.output_token_ids for o in run(plain, prompts(), params)]
    if family == "mistral":  # (Qwen2's tiny config mixes a full and a sliding layer: one call per layer)
        assert plain.target.native is not None and direct and all(direct)
        native, plain.target.native = plain.target.native, None
        assert [o.output_token_ids for o in run(plain, prompts(), params)] == expected
        plain.target.native = native
    else:
        assert plain.target.native is None and not direct
    core = make_core(path, path, k=3, quantization="int4", block_size=4, max_num_batched_tokens=8)
    outs = run(core, prompts(), params, join_after=2, join_from=1)
    assert [o.output_token_ids for o in outs] == expected
    drafted = sum(o.speculation.num_draft_tokens for o in outs)
    assert drafted > 0 and sum(o.speculation.num_accepted_tokens for o in outs) == drafted  # its own draft: all kept


def test_a_hooked_layer_keeps_the_decoder_layer_by_layer(tiny, monkeypatch):
    """Hidden-state taps (EAGLE-3, Medusa, DFlash) hook decoder layers: those forwards run one call per layer, so
    every hook sees its own layer's output."""
    core = make_core(tiny["llama"], quantization="int4")
    layers = decoder_layers(core.target.model)
    seen, stacks = [], []
    run_stack = NativeStack.run
    monkeypatch.setattr(NativeStack, "run", lambda self, *a: stacks.append(1) or run_stack(self, *a))
    plain = [o.output_token_ids for o in run(core, PROMPTS[:2], GREEDY)]
    assert stacks  # decode forwards ran the whole decoder in one call
    stacks.clear()
    handle = layers[0].register_forward_hook(lambda module, args, out: seen.append(out.clone()))
    try:
        hooked = [o.output_token_ids for o in run(core, PROMPTS[:2], GREEDY)]
    finally:
        handle.remove()
    assert not stacks and seen and hooked == plain
    base, forwards, run_forward = core.target.model.model, [], core.target.run
    monkeypatch.setattr(core.target, "run", lambda *a, **kw: forwards.append(1) or run_forward(*a, **kw))
    for module in (core.target.model, base):  # a hook on the model: transformers' forward runs, the decoder still in
        seen.clear()                          # one call, and the hook sees every forward
        forwards.clear()
        handle = module.register_forward_hook(lambda module, args, out: seen.append(1))
        try:
            assert [o.output_token_ids for o in run(core, PROMPTS[:2], GREEDY)] == plain
        finally:
            handle.remove()
        assert stacks and len(seen) == len(forwards)
        stacks.clear()
    handle = layers[1].self_attn.o_proj.register_forward_hook(lambda module, args, out: seen.append(out.clone()))
    try:  # a later layer's o_proj (tensor parallelism's all-reduce): that layer leaves the kernel, so the stack too
        seen.clear()
        assert [o.output_token_ids for o in run(core, PROMPTS[:2], GREEDY)] == plain
    finally:
        handle.remove()
    assert not stacks and seen
