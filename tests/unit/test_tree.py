"""Token trees: structure, one tree forward == each root-to-leaf path run alone, and the lossless tree rule (exact
greedy walk; the law of sampled output, with a deliberately lossy variant the test must reject)."""

import pytest
import torch
from scipy.stats import chisquare
from transformers import AutoModelForCausalLM

from specserve.engine.model.attention import SeqChunk
from specserve.engine.model.loader import load_model
from specserve.engine.model.runner import ModelRunner
from specserve.engine.sample.sampler import sample
from specserve.engine.sample.tree import ancestor_matrix, chain_parents, check_tree, depths, tree_sample
from specserve.engine.sched.block_allocator import BlockAllocator
from specserve.engine.sched.kv_cache import KVPool
from tests.unit.test_model_runner import models  # noqa: F401  (the same tiny Llama and GPT-2, a fixture)

CPU = torch.device("cpu")
# node j's parent at index j - 1:   root(0) -> 1 -> 3 -> 5
#                                      \-> 2 -> 4
#                                       \-> 6
PARENTS = [0, 0, 1, 2, 3, 0]


def test_ancestors_and_depths():
    anc = ancestor_matrix(torch.tensor([PARENTS]))[0]
    assert anc[5].nonzero()[:, 0].tolist() == [0, 1, 3, 5]
    assert anc[4].nonzero()[:, 0].tolist() == [0, 2, 4]
    assert anc[6].nonzero()[:, 0].tolist() == [0, 6]
    assert depths(anc[None])[0].tolist() == [0, 1, 1, 2, 2, 3, 1]
    chain = ancestor_matrix(chain_parents(2, 5))
    assert torch.equal(chain[0], torch.tril(torch.ones(6, 6, dtype=torch.bool)))


def test_check_tree_refuses_bad_parents_and_duplicate_siblings():
    check_tree(PARENTS, [1, 2, 3, 4, 5, 6])
    with pytest.raises(ValueError, match="parent 2 must be in"):
        check_tree([0, 2], [1, 2])
    with pytest.raises(ValueError, match="sibling already proposes token 7"):
        check_tree([0, 0], [7, 7])


@pytest.mark.parametrize("stable", [False, True], ids=["plain", "stable"])  # a compiled engine's padded metadata
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_tree_forward_equals_each_path_alone(models, arch, stable):  # noqa: F811
    """One forward over a context + a 7-node tree (and a causal neighbour in the same batch) gives, at every node,
    the logits of its root-to-node path run as a plain sequence."""
    vocab = models["vocab"]
    model = load_model(models[arch], torch.float32, CPU)
    gen = torch.Generator().manual_seed(0)
    context = torch.randint(1, vocab, (9,), generator=gen).tolist()
    other = torch.randint(1, vocab, (6,), generator=gen).tolist()
    nodes = torch.randint(1, vocab, (len(PARENTS),), generator=gen).tolist()
    alloc = BlockAllocator(num_blocks=16, block_size=4)
    tables = [alloc.allocate(5), alloc.allocate(3)]
    runner = ModelRunner(model, KVPool.allocate(model.config, alloc.num_blocks, 4, torch.float32, CPU), CPU, vocab)
    runner.stable_shapes = stable
    runner.forward(torch.tensor(context[:-1] + other[:-1]), [SeqChunk(tables[0], 0, 8), SeqChunk(tables[1], 0, 5)],
                   torch.tensor([0]))
    # the root is the context's last token; the tree's nodes follow it in slots 9.., at positions 8 + depth
    ids = torch.tensor([context[-1], *nodes, other[-1]])
    chunks = [SeqChunk(tables[0], 8, 1 + len(nodes), parents=tuple(PARENTS)), SeqChunk(tables[1], 5, 1)]
    logits = runner.forward(ids, chunks, torch.arange(len(ids)))
    anc = ancestor_matrix(torch.tensor([PARENTS]))[0]
    ref_model = AutoModelForCausalLM.from_pretrained(str(models[arch]), dtype=torch.float32).eval()
    with torch.no_grad():
        for node in range(len(PARENTS) + 1):
            path = [nodes[a - 1] for a in anc[node].nonzero()[:, 0].tolist() if a > 0]
            ref = ref_model(input_ids=torch.tensor([context + path])).logits[0, -1]
            assert torch.allclose(logits[node], ref, atol=1e-4), node
        ref = ref_model(input_ids=torch.tensor([other])).logits[0, -1]
    assert torch.allclose(logits[-1], ref, atol=1e-4)


def test_greedy_tree_walk_follows_the_argmax():
    vocab = 8
    tokens = torch.tensor([[3, 4, 5, 6, 7, 2]])  # node tokens, tree PARENTS
    parents = torch.tensor([PARENTS])
    anc = ancestor_matrix(parents)
    argmax = [4, 5, 6, 1, 1, 1, 1]  # root -> 4 (node 2) -> 6 (node 4) -> argmax at node 4 is 1: emitted
    p = torch.nn.functional.one_hot(torch.tensor([argmax]), vocab).float()
    out, m, path = tree_sample(p, tokens, parents, anc, torch.tensor([6]), torch.ones(1, 7, vocab))
    assert m.tolist() == [2] and out[0, :3].tolist() == [4, 6, 1] and out[0, 3:].tolist() == [-1] * 4
    assert path[0, :3].tolist() == [0, 2, 4]
    # fewer nodes proposed: node 4 is not part of the proposal, so the walk stops at node 2
    out, m, path = tree_sample(p, tokens, parents, anc, torch.tensor([3]), torch.ones(1, 7, vocab))
    assert m.tolist() == [1] and out[0, :2].tolist() == [4, 6]


def _lossy_tree_sample(p, tokens, parents, anc, num, noise, *relaxed):
    """Medusa-style shortcut (lossy: it accepts tokens the target would not have drawn): keep a child whose token the
    target finds likely enough."""
    out, m, path = tree_sample(p, tokens, parents, anc, num, noise, *relaxed)
    if tokens.shape[1] == 0:
        return out, m, path
    likely = (p[:, 0].gather(1, tokens[:, :1])[:, 0] > 0.2) & (num > 0)  # root child 1 kept whenever p > 0.2
    out = out.clone()
    out[likely, 0] = tokens[likely, 0]
    return out, m, path


@pytest.mark.parametrize("sampler,lossless", [(tree_sample, True), (_lossy_tree_sample, False)])
def test_law_of_two_tokens_through_a_tree(sampler, lossless):
    """The first two emitted tokens of 40k independent rows follow p(y0) p(y1 | y0) (chi-square), where the second
    token comes from the same step when the tree got that far and from a fresh draw otherwise."""
    vocab, n = 5, 40_000
    gen = torch.Generator().manual_seed(1)
    p0 = torch.softmax(torch.randn(vocab, generator=gen) * 1.5, -1)  # p(. | context)
    p1 = torch.softmax(torch.randn(vocab, vocab, generator=gen) * 1.5, -1)  # p(. | context, y0)
    p2 = torch.softmax(torch.randn(vocab, generator=gen), -1)  # deeper: any distribution
    # tree: root -> {1: token 0 -> {3: token 2}, 2: token 3}
    parents = torch.tensor([[0, 0, 1]]).expand(n, 3)
    tokens = torch.tensor([[0, 3, 2]]).expand(n, 3)
    probs = torch.stack([p0, p1[0], p1[3], p2]).expand(n, 4, vocab)  # p at root, node 1 (y0=0), 2 (y0=3), 3
    noise = torch.empty(n, 4, vocab).exponential_(generator=gen)
    out, m, _ = sampler(probs, tokens, parents, ancestor_matrix(parents), torch.full((n,), 3), noise)
    y0 = out[:, 0]
    fresh = sample(p1[y0], torch.empty(n, vocab).exponential_(generator=gen))
    y1 = torch.where(m >= 1, out[:, 1], fresh)
    observed = torch.bincount(y0 * vocab + y1, minlength=vocab * vocab).double()
    expected = (p0[:, None] * p1).reshape(-1).double()
    expected = expected / expected.sum() * n
    pvalue = chisquare(observed, expected).pvalue
    if lossless:
        assert pvalue > 1e-3
        assert (m >= 1).float().mean() > 0.2  # the tree was used
    else:
        assert pvalue < 1e-6
