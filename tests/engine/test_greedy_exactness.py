"""Greedy speculative output is token-identical to target-only greedy decoding (fp32)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specserve.engine.sampling_params import SamplingParams
from tests.engine.helpers import make_core, run

PROMPTS = ["The quick brown fox", "def main():", "Speculative decoding proposes tokens with a draft and",
           "café", "x", "Ünïcödé text: café, naïve, 東京 and ∑ symbols keep byte-level BPE honest. The quick",
           "verifies them", "return 0\n", "lazy dog. def", "brown"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def baselines(tiny):
    return {name: [o.output_token_ids for o in run(make_core(tiny[name]), PROMPTS, GREEDY)]
            for name in ("llama", "gpt2")}


def test_engine_plain_greedy_matches_hf_generate(tiny, baselines):
    model = AutoModelForCausalLM.from_pretrained(tiny["llama"], dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny["llama"])
    for prompt, ours in zip(PROMPTS[:4], baselines["llama"]):
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        ref = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None)
        assert ref[0, ids.shape[1]:].tolist() == ours


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("draft", ["llama_draft", "self"])
def test_spec_greedy_identical_with_joins(tiny, baselines, k, draft):
    draft_path = tiny["llama"] if draft == "self" else tiny[draft]
    core = make_core(tiny["llama"], draft_path, k=k)
    outs = run(core, PROMPTS, GREEDY, join_after=3, join_from=6)
    assert [o.output_token_ids for o in outs] == baselines["llama"]
    drafted = sum(o.speculation.num_draft_tokens for o in outs)
    accepted = sum(o.speculation.num_accepted_tokens for o in outs)
    assert drafted > 0
    if draft == "self":  # the target as its own draft: everything accepted, bonus tokens, draft catch-up
        assert accepted == drafted
        assert all(o.speculation.num_steps < 24 for o in outs)
    else:  # a different random model: most proposals rejected
        assert accepted < drafted
    assert core.allocator.usage == 0.0


def test_gpt2_pair_greedy_identical(tiny, baselines):
    outs = run(make_core(tiny["gpt2"], tiny["gpt2_draft"], k=4), PROMPTS, GREEDY, join_after=2)
    assert [o.output_token_ids for o in outs] == baselines["gpt2"]


def test_per_request_k_within_one_batch(tiny, baselines):
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, num_speculative_tokens=i % 5)
              for i in range(len(PROMPTS))]
    outs = run(make_core(tiny["llama"], tiny["llama"], k=3), PROMPTS, params)
    assert [o.output_token_ids for o in outs] == baselines["llama"]
    for i, o in enumerate(outs):
        k = min(i % 5, 3)
        assert (o.speculation.num_draft_tokens == 0) == (k == 0)
        assert o.speculation.method == ("draft" if k else "none")
        if k:  # every step drafted at most k tokens
            assert o.speculation.num_draft_tokens <= k * o.speculation.num_steps


def test_chunked_prefill_and_preemption_keep_greedy_identical(tiny, baselines):
    # 16-token batches force chunked prefill of the long prompt; 30 blocks of 4 tokens (target 512 B + draft
    # 128 B per token in fp32) cannot hold all ten requests at once, which forces recompute preemption
    core = make_core(tiny["llama"], tiny["llama_draft"], k=3, max_num_batched_tokens=16, block_size=4,
                     kv_cache_memory=30 * 4 * (512 + 128))
    outs = run(core, PROMPTS, GREEDY, join_after=1)
    assert [o.output_token_ids for o in outs] == baselines["llama"]
    assert core.totals.num_preemptions > 0
    assert core.allocator.num_blocks == 30
    assert core.allocator.usage == 0.0


def test_permuted_vocabulary_map_self_draft_accepts_everything(tiny, baselines, tmp_path):
    """The target re-indexed through a random draft-to-target map (plus the unknown row) is still the target: a
    wrong id map anywhere (inputs or logits) would show as rejections, which greedy identity alone cannot see."""
    from specserve.engine.model.vocab_map import save_vocab_map

    model = AutoModelForCausalLM.from_pretrained(tiny["llama"], dtype=torch.float32)
    vocab = model.config.vocab_size
    d2t = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))
    cfg = model.config.__class__.from_dict({**model.config.to_dict(), "vocab_size": vocab + 1})
    mapped = type(model)(cfg)
    state = model.state_dict()
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        state[name] = torch.cat([state[name][d2t], torch.zeros(1, state[name].shape[1])])
    mapped.load_state_dict(state)
    mapped.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny["llama"]).save_pretrained(tmp_path)
    save_vocab_map(tmp_path, d2t)
    outs = run(make_core(tiny["llama"], tmp_path, k=3), PROMPTS, GREEDY, join_after=3, join_from=6)
    assert [o.output_token_ids for o in outs] == baselines["llama"]
    drafted = sum(o.speculation.num_draft_tokens for o in outs)
    assert drafted > 0 and sum(o.speculation.num_accepted_tokens for o in outs) == drafted
