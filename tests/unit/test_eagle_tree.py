"""EAGLE-2's dynamic tree bookkeeping (engine/spec_decode/eagle3/tree.py), checked against a brute-force reference:
the chosen nodes are the budget best by cumulative log-probability, ancestor-closed, best first (a topological
order whose every prefix is the tree of a smaller budget); expansion
stops exactly when no frontier node can enter a tree."""

import torch

from specserve.engine.sample.tree import check_tree
from specserve.engine.spec_decode.eagle3.tree import DynamicTree


def _logp(*rows):
    return torch.log(torch.tensor(rows, dtype=torch.float32))


def test_first_frontier_is_the_roots_top_k():
    tree = DynamicTree(_logp([0.1, 0.6, 0.3]), topk=2)
    assert tree.front_tokens.tolist() == [[1, 2]]
    tokens, parents = tree.select([2])
    assert tokens == [[1, 2]] and parents == [[0, 0]]


def test_expansion_and_selection_match_brute_force():
    torch.manual_seed(0)
    vocab, topk, depths, budget = 5, 2, 3, 6
    root = torch.log_softmax(torch.randn(1, vocab), -1)
    step = [torch.log_softmax(torch.randn(1, topk, vocab), -1) for _ in range(depths)]
    tree = DynamicTree(root, topk)
    nodes = [(float(root[0, t]), (t,)) for t in root[0].topk(topk).indices.tolist()]  # (score, path)
    front = list(nodes)
    for d in range(depths):
        tree.expand(step[d])
        children = []
        for row, (score, path) in enumerate(front):  # the frontier in the tree's own row order
            for t in step[d][0, row].topk(topk).indices.tolist():
                children.append((score + float(step[d][0, row, t]), path + (t,)))
        nodes += children
        front = sorted(children, key=lambda c: -c[0])[:topk]
        assert tree.front_tokens[0].tolist() == [p[-1] for _, p in front]
    tokens, parents = tree.select([budget])
    assert check_tree(parents[0], tokens[0]) >= 1
    paths = []
    for j, t in enumerate(tokens[0]):  # rebuild each chosen node's path
        paths.append((paths[parents[0][j] - 1] if parents[0][j] else ()) + (t,))
    best = sorted(nodes, key=lambda c: -c[0])[:budget]
    assert sorted(paths) == sorted(p for _, p in best)
    assert all(parents[0][j] <= j for j in range(len(paths)))  # topological: a parent comes first
    assert [p for p in paths] == [p for _, p in best]  # best first
    assert tree.select([3]) == ([tokens[0][:3]], [parents[0][:3]])  # a smaller budget: a prefix


def test_done_when_no_frontier_node_beats_the_budget_th_best():
    tree = DynamicTree(_logp([0.5, 0.3, 0.2]), topk=2)  # frontier 0.5, 0.3
    assert not tree.done(torch.tensor([3]))  # only 2 candidates: a third is still wanted
    assert not tree.done(torch.tensor([2]))  # 0.5 >= the 2nd best (0.3): its children could still tie
    tree.expand(_logp([[0.01, 0.01, 0.98], [0.98, 0.01, 0.01]]).unsqueeze(0))
    # candidates: 0.5, 0.3, 0.49, 0.005, 0.294, 0.003; frontier: 0.49, 0.294
    assert not tree.done(torch.tensor([3]))
    assert tree.done(torch.tensor([1]))  # 0.49 < 0.5: nothing below can become the single best
    assert tree.done(torch.tensor([0]))


def test_rows_keep_their_own_budgets():
    root = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.0], [0.0, 1.0, 2.0]]), -1)
    tree = DynamicTree(root, topk=2)
    tree.expand(torch.log_softmax(torch.zeros(2, 2, 3), -1))
    tokens, parents = tree.select([1, 3])
    assert tokens[0] == [0] and parents[0] == [0]
    # row 1: root children 2 (0.665), 1 (0.245); then the first child of 2 (0.665 / 3 = 0.222) beats 1's (0.082)
    assert tokens[1] == [2, 1, 0] and parents[1] == [0, 0, 1]
