"""Medusa trees: parsing user trees, the node layout, and the tree chosen from accuracy and verify cost."""

import pytest

from specserve.engine.spec_decode.medusa.tree import (
    best_paths,
    choose_tree,
    default_tree,
    layout,
    parse_choices,
    path_probabilities,
)


def test_parse_keeps_a_best_first_order_sorts_others_by_length_and_checks_prefixes():
    assert parse_choices("[[0, 0], [0], [1]]", 2) == [(0,), (1,), (0, 0)]  # a path before its prefix: by length
    # every path after its prefix: the given order stays, so the first k nodes are the k best (and a tree)
    assert parse_choices("[[0], [0, 0], [1], [0, 0, 0]]", 3) == [(0,), (0, 0), (1,), (0, 0, 0)]
    for bad, msg in [("[[0, 1]]", "prefix"), ("[[0], [0]]", "twice"), ("[[0, 0, 0]]", "deeper"), ("[]", "non-empty"),
                     ("[[-1]]", "ranks"), ("[[true]]", "ranks"), ("{", "invalid JSON")]:
        with pytest.raises(ValueError, match=msg):
            parse_choices(bad, 2)


def test_layout_gives_parents_heads_and_ranks():
    parents, heads, ranks = layout([(0,), (1,), (0, 0), (0, 1), (1, 0)])
    assert parents == [0, 0, 1, 1, 2] and heads == [0, 0, 1, 1, 1] and ranks == [0, 1, 0, 1, 0]


def test_best_paths_are_prefix_closed_and_ordered():
    acc = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.1, 0.05]]
    ranked = best_paths(acc, 12)
    probs = [p for _, p in ranked]
    assert probs == sorted(probs, reverse=True)
    seen = set()
    for path, prob in ranked:
        assert len(path) == 1 or path[:-1] in seen  # any prefix of this order is a tree
        seen.add(path)
        assert prob == pytest.approx(path_probabilities([path], acc)[0])


def test_choose_tree_weighs_cost_against_acceptance():
    acc = [[0.6, 0.2], [0.5, 0.2]]
    cheap, info = choose_tree(acc, lambda rows: 1.0)  # verifying is free: take every useful node
    assert len(cheap) == 6 and info["predicted_speedup"] > 1
    steep, info = choose_tree(acc, lambda rows: float(rows))  # cost grows with every row: nothing pays
    assert steep == [] and info["predicted_speedup"] == 1.0
    assert default_tree(3)[0] == (0,)
