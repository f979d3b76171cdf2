"""Adaptive k: the cost fit, the acceptance estimates, and the plan's choices in the regimes that matter (pays /
does not pay / some rows pay / probing)."""

import pytest

from specserve.engine.spec_decode.adaptive import (
    MARGIN,
    PRIOR_ACCEPT,
    AcceptanceTracker,
    LinearCost,
    Row,
    goodput,
    plan,
)


def _cost(a=0.030, b=0.0006, xs=(1, 5, 9, 16, 32, 64)):
    c = LinearCost()
    for _ in range(30):
        for x in xs:
            c.observe(x, a + b * x)
    return c


def test_linear_cost_fits_the_line_and_keeps_a_prior_slope_when_x_never_varies():
    a, b = _cost().coefficients()
    assert a == pytest.approx(0.030, rel=0.05) and b == pytest.approx(0.0006, rel=0.1)
    flat = LinearCost()
    for _ in range(50):
        flat.observe(4, 0.05)
    a, b = flat.coefficients()
    assert flat(4) == pytest.approx(0.05, rel=0.05) and 0 < b < 0.05 * 0.05
    assert not LinearCost().known
    # a long prefill first, then decode steps of 1 token: the intercept is the decode cost, never 0
    mixed = LinearCost()
    mixed.observe(60, 0.090)
    for _ in range(20):
        mixed.observe(1, 0.027)
    a, b = mixed.coefficients()
    assert a == pytest.approx(0.027, rel=0.1) and b == pytest.approx((0.090 - 0.027) / 59, rel=0.5)


def test_tracker_estimates_per_position_and_starts_from_the_method():
    t = AcceptanceTracker(4)
    assert t.survival("a", "draft") == pytest.approx([PRIOR_ACCEPT ** j for j in range(1, 5)])
    for _ in range(40):
        t.observe("a", "draft", 4, 1)  # first draft always accepted, second always rejected
    rates = t.rates("a", "draft")
    assert rates[0] > 0.99 and rates[1] < 0.01 and rates[2] == PRIOR_ACCEPT  # position 3 never observed
    assert t.survival("a", "draft")[1] < 0.01
    assert t.rates("b", "draft")[0] > PRIOR_ACCEPT  # a new request starts from the method's estimates
    t.forget("a")
    assert t.rates("a", "draft") == t.rates("b", "draft")


def test_plan_speculates_fully_when_it_pays_and_not_at_all_when_it_does_not():
    cost = _cost()
    good = [Row([0.9, 0.81, 0.73, 0.66], 4, "draft")] * 2
    assert plan(good, 2, 2, cost, {"draft": 0.002}) == [4, 4]
    bad = [Row([0.05, 0.0025, 0.0001, 0.0], 4, "draft")] * 2
    assert plan(bad, 2, 2, cost, {"draft": 0.003}) == [0, 0]
    # good acceptance, but each draft position costs as much as a target forward: not worth it
    assert plan(good, 2, 2, cost, {"draft": 0.05}) == [0, 0]


def test_plan_does_not_take_a_break_even_speculation():
    """16 streams at acceptance 0.35: k = 1 for all promises under MARGIN more goodput than plain, so plain it is."""
    cost = _cost()
    rows = [Row([0.35, 0.12, 0.04, 0.01], 4, "draft")] * 16
    gain = goodput(rows, [1] * 16, 16, 16, cost, {"draft": 0.0035}) / goodput(rows, [0] * 16, 16, 16, cost, {})
    assert 1.0 < gain < 1 + MARGIN  # it would pay on paper, barely
    assert plan(rows, 16, 16, cost, {"draft": 0.0035}) == [0] * 16
    assert plan(rows[:1], 1, 1, cost, {"draft": 0.0035}) == [1]  # one stream: the same acceptance clearly pays


def test_plan_trims_rows_whose_slots_do_not_pay_and_probes_idle_ones():
    cost = _cost(a=0.010, b=0.002)  # verify work is expensive per token here
    rows = [Row([0.95, 0.9, 0.85, 0.8], 4, "ngram"), Row([0.01, 0.0, 0.0, 0.0], 4, "ngram"),
            Row([0.01, 0.0, 0.0, 0.0], 4, "ngram", probe=True)]
    ks = plan(rows, 3, 3, cost, {})
    assert ks[0] >= 3 and ks[1] == 0 and ks[2] == 1
    assert goodput(rows, ks, 3, 3, cost, {}) > goodput(rows, [0, 0, 0], 3, 3, cost, {})


def test_plan_before_any_measurement_proposes_the_caps():
    assert plan([Row([0.1] * 4, 3, "draft"), Row([0.1] * 4, 0, "draft")], 2, 2, LinearCost(), {}) == [3, 0]


def test_recent_median_ignores_a_one_off_spike():
    from specserve.engine.spec_decode.adaptive import RecentMedian

    m = RecentMedian(5)
    assert m.add(1.0) == 1.0
    assert m.add(50.0) == 25.5 and m.add(1.2) == 1.2 and m.add(0.9) == pytest.approx(1.1)


def test_tracker_estimates_tree_nodes_directly():
    """A tree method's slot j is node j: its survival is P(node j is on the accepted path), estimated directly
    (a chain's product of per-position rates would credit siblings with their elder's acceptance)."""
    t = AcceptanceTracker(6, tree_methods=frozenset({"medusa"}))
    assert t.survival("a", "medusa") == pytest.approx([PRIOR_ACCEPT ** j for j in range(1, 7)])
    for _ in range(80):  # nodes 1 and 2 are siblings at depth 1 (node 2 always wins), node 5 is node 2's child
        t.observe("a", "medusa", 5, 2, path=[0, 2, 5])
    s = t.survival("a", "medusa")
    assert s[0] < 0.01 and s[1] > 0.99 and s[2] < 0.01 and s[3] < 0.01 and s[4] > 0.99
    assert s[5] == pytest.approx(PRIOR_ACCEPT ** 6)  # node 6 was never proposed
    assert t.survival("b", "medusa")[1] > PRIOR_ACCEPT ** 2  # a new request starts from the method's estimates
    t.observe("a", "medusa", 2, 0)  # a chain step of a tree method (no path given): nothing accepted
    assert t.survival("a", "medusa")[1] < 0.99
    # chains are unchanged: node j accepted iff the first j were
    chain = AcceptanceTracker(4)
    chain.observe("a", "draft", 4, 2, path=[0, 1, 2])
    assert chain.rates("a", "draft")[2] < PRIOR_ACCEPT


def test_a_per_step_cost_is_paid_once_whatever_the_tree_size():
    """Medusa's heads cost the same for 3 nodes or 16: charged per position, a wide tree looks 16x dearer than it is
    and the plan stays small; charged once, the plan takes the nodes whose survival pays for their verify rows."""
    cost = _cost(a=0.040, b=0.001)
    survival = [0.3, 0.15, 0.1, 0.08, 0.06, 0.05, 0.04, 0.03] + [0.02] * 8
    rows = [Row(survival, 16, "medusa")]
    assert goodput(rows, [8], 1, 1, cost, {"medusa": 0.004}, frozenset({"medusa"})) == pytest.approx(
        goodput(rows, [8], 1, 1, cost, {"medusa": 0.0005}))  # 4 ms once = 0.5 ms x 8 positions
    per_position = plan(rows, 1, 1, cost, {"medusa": 0.004})
    per_step = plan(rows, 1, 1, cost, {"medusa": 0.004}, frozenset({"medusa"}))
    assert per_position[0] < per_step[0]
    assert all(s >= 0.02 for s in survival[: per_step[0]])  # every node kept is worth its verify row


def test_a_tree_request_keeps_its_estimate_through_a_few_misses():
    """Medusa's first node is right ~1 step in 4: three misses in a row must not take a request's estimate to ~0
    (then it stops speculating); a chain's estimate moves faster, as before."""
    tree, chain = AcceptanceTracker(4, frozenset({"medusa"})), AcceptanceTracker(4)
    for i in range(200):  # the method's estimate, which a new request starts from: 0.25
        hit = i % 4 == 0
        tree.observe("warm", "medusa", 1, int(hit), path=[0, 1] if hit else [0])
    for _ in range(3):
        tree.observe("a", "medusa", 1, 0, path=[0])
        chain.observe("a", "draft", 1, 0)
    assert tree.survival("a", "medusa")[0] > 0.15
    assert chain.survival("a", "draft")[0] < 0.25
