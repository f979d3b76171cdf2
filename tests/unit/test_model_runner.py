"""One ragged forward on the engine's paged KV cache equals plain HF forwards of each sequence: chunked prefill,
non-contiguous block tables, grouped-query attention, and rollback by overwriting rejected positions."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve.engine.model.attention import SeqChunk
from specserve.engine.model.loader import load_model
from specserve.engine.model.runner import ModelRunner
from specserve.engine.sched.block_allocator import BlockAllocator
from specserve.engine.sched.kv_cache import KVPool
from tests.tiny_models import build_tokenizer, save_gpt2, save_llama

CPU = torch.device("cpu")
BLOCK = 4
TOL = 1e-4


@pytest.fixture(params=["sdpa", "eager"])
def attention(request, monkeypatch):
    """Both attention paths: SDPA (fp32, prefill chunks, CUDA) and the eager math CPU bf16 uses for short queries
    (specserve.engine.model.attention.eager_is_faster), here forced in fp32 so that it is held to the same tolerance."""
    if request.param == "eager":
        import specserve.engine.model.attention
        module = specserve.engine.model.attention
        monkeypatch.setattr(module, "eager_is_faster", lambda q: q.shape[2] <= module.SHORT_QUERY)
    return request.param


@pytest.fixture(params=[False, True], ids=["plain", "stable"])
def stable(request):
    """A compiled engine's metadata (build_metadata(stable=True): no size 1, both query groups always present,
    stand-in rows writing to a spare output row) must give the same logits."""
    return request.param


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("runner")
    vocab = len(build_tokenizer(root / "tok"))
    return {
        "vocab": vocab,
        "llama": save_llama(root / "llama", root / "tok", vocab, layers=2, hidden=64, heads=4, kv_heads=2, seed=5),
        "gpt2": save_gpt2(root / "gpt2", root / "tok", vocab, layers=2, hidden=64, heads=4, seed=6),
    }


def _reference(path, seq):
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(input_ids=torch.tensor(seq)[None]).logits[0].float()  # [L, V]


def _interleaved_tables(alloc, quotas):
    """Hand out blocks one at a time round-robin, so no sequence's blocks are contiguous."""
    tables = [[] for _ in quotas]
    while any(len(t) < q for t, q in zip(tables, quotas)):
        for t, q in zip(tables, quotas):
            if len(t) < q:
                t.extend(alloc.allocate(1))
    return tables


def _step(runner, seqs, chunks, rows=None):
    """Run one ragged forward; rows[b] = offsets inside chunk b whose logits are wanted (default: all)."""
    input_ids = torch.tensor([t for s, c in zip(seqs, chunks) for t in s[c.start:c.start + c.num_new]])
    rows = rows or [list(range(c.num_new)) for c in chunks]
    first = 0
    index = []
    for c, r in zip(chunks, rows):
        index += [first + j for j in r]
        first += c.num_new
    logits = runner.forward(input_ids, chunks, torch.tensor(index))
    out, n = [], 0
    for r in rows:
        out.append(logits[n:n + len(r)])
        n += len(r)
    return out


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_chunked_ragged_forward_and_rollback_match_hf(models, arch, attention, stable):
    path, vocab = models[arch], models["vocab"]
    model = load_model(path, torch.float32, CPU)
    if arch == "llama":
        assert model.config.num_key_value_heads < model.config.num_attention_heads  # grouped-query attention
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in (7, 13, 5)]
    final_len = [8, 13, 6]  # lengths reached by the end of the test (rollback rewrites / extends)
    alloc = BlockAllocator(num_blocks=12, block_size=BLOCK)
    tables = _interleaved_tables(alloc, [alloc.blocks_for(n) for n in final_len])
    tables[1] = tables[1][::-1]  # not even increasing
    assert tables == [[0, 3], [7, 6, 4, 1], [2, 5]]
    kv = KVPool.allocate(model.config, alloc.num_blocks, BLOCK, torch.float32, CPU)
    runner = ModelRunner(model, kv, CPU, vocab)
    runner.stable_shapes = stable
    refs = [_reference(path, s) for s in seqs]

    # step 1: partial prefill of every sequence
    split = [3, 8, 2]
    chunks = [SeqChunk(t, 0, p) for t, p in zip(tables, split)]
    for b, got in enumerate(_step(runner, seqs, chunks)):
        assert got.shape == (split[b], vocab)
        assert (got - refs[b][: split[b]]).abs().max() < TOL, (arch, "prefill", b)

    # step 2: the rest of each prompt, attending to the K/V written in step 1
    chunks = [SeqChunk(t, p, len(s) - p) for t, p, s in zip(tables, split, seqs)]
    for b, got in enumerate(_step(runner, seqs, chunks)):
        assert (got - refs[b][split[b]:]).abs().max() < TOL, (arch, "rest", b)

    # step 3: rollback. Seq 0 rewrites positions 5..7 (one past its old end), seq 1 rewrites 9..10 and leaves stale
    # K/V at 11..12 (must be ignored), seq 2 decodes one token at position 5. Only each chunk's last row is wanted.
    new = [seqs[0][:5] + [11, 12, 13], seqs[1][:9] + [21, 22], seqs[2] + [31]]
    assert new[1][9:11] != seqs[1][9:11]
    chunks = [SeqChunk(tables[0], 5, 3), SeqChunk(tables[1], 9, 2), SeqChunk(tables[2], 5, 1)]
    got = _step(runner, new, chunks, rows=[[2], [1], [0]])
    for b, s in enumerate(new):
        ref = _reference(path, s)
        assert (got[b][0] - ref[-1]).abs().max() < TOL, (arch, "rollback", b)

    # step 4: seq 1 rolls back further and decodes, alone in the batch
    again = new[1][:6] + [41]
    got = _step(runner, [again], [SeqChunk(tables[1], 6, 1)])
    assert (got[0][0] - _reference(path, again)[-1]).abs().max() < TOL, (arch, "rollback alone")


def test_logits_are_cut_or_padded_to_the_target_vocabulary(models):
    path, vocab = models["llama"], models["vocab"]
    model = load_model(path, torch.float32, CPU)
    seq = [5, 6, 7, 8, 9]
    ref = _reference(path, seq)
    for width in (vocab - 20, vocab + 3):
        kv = KVPool.allocate(model.config, 2, BLOCK, torch.float32, CPU)
        runner = ModelRunner(model, kv, CPU, width)
        logits = runner.forward(torch.tensor(seq), [SeqChunk([1, 0], 0, 5)], torch.tensor([4]))
        assert logits.shape == (1, width) and logits.dtype == torch.float32
        shared = min(width, vocab)
        assert (logits[0, :shared] - ref[-1, :shared]).abs().max() < TOL
        if width > vocab:
            assert torch.isneginf(logits[0, vocab:]).all()  # a padded id can never be proposed


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_decode_rows_and_a_long_prefill_in_one_forward_match_hf(models, arch, attention, stable):
    """Short chunks (decode) and long ones (prefill) attend in separate query groups; the outputs must come back
    in the forward's token order, whatever order the chunks arrive in."""
    from specserve.engine.model.attention import SHORT_QUERY, build_metadata
    path, vocab = models[arch], models["vocab"]
    model = load_model(path, torch.float32, CPU)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in (6, SHORT_QUERY + 9, 4, SHORT_QUERY + 3)]
    alloc = BlockAllocator(num_blocks=24, block_size=BLOCK)
    tables = _interleaved_tables(alloc, [alloc.blocks_for(len(s)) for s in seqs])
    kv = KVPool.allocate(model.config, alloc.num_blocks, BLOCK, torch.float32, CPU)
    runner = ModelRunner(model, kv, CPU, vocab)
    runner.stable_shapes = stable
    # seqs 0 and 2 prefill all but their last token first; then one forward: decode, long prefill, decode, prefill
    _step(runner, [seqs[0], seqs[2]], [SeqChunk(tables[0], 0, 5), SeqChunk(tables[2], 0, 3)])
    chunks = [SeqChunk(tables[0], 5, 1), SeqChunk(tables[1], 0, len(seqs[1])), SeqChunk(tables[2], 3, 1),
              SeqChunk(tables[3], 0, len(seqs[3]))]
    md, _ = build_metadata(kv, chunks, CPU)
    assert [len(g.starts) for g in md.groups] == [2, 2]  # two decode rows, two prefill rows
    assert [g.query_index.shape[1] for g in md.groups] == [1, SHORT_QUERY + 9]  # decode rows are not padded
    got = _step(runner, seqs, chunks, rows=[[0], list(range(len(seqs[1]))), [0], list(range(len(seqs[3])))])
    refs = [_reference(path, s) for s in seqs]
    assert (got[0][0] - refs[0][-1]).abs().max() < TOL
    assert (got[1] - refs[1]).abs().max() < TOL
    assert (got[2][0] - refs[2][-1]).abs().max() < TOL
    assert (got[3] - refs[3]).abs().max() < TOL
