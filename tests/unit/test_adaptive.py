"""Adaptive k: the step cost model, the acceptance estimates, and the plan's choices in the regimes that matter
(pays / does not pay / some rows pay / padding / probing)."""

import pytest

from specserve.engine.spec_decode.acceptance import PRIOR_WEIGHT, PROBE_EVERY, AcceptanceTracker
from specserve.engine.spec_decode.adaptive import Row, StepBase, goodput, plan
from specserve.engine.spec_decode.costs import OnlineLinear, StepCosts, forward_prior, proposer_prior


def _costs(a=0.030, b=0.0006, pad=0.0, draft: dict | None = None, xs=(1, 5, 9, 16, 32, 64)):
    """Step costs fitted on exact observations: forward a + b tokens + pad padded slots, proposer per position."""
    c = StepCosts()
    for _ in range(30):
        for x in xs:
            for padded in (x, 2 * x, 4 * x):  # one row, or short rows padded to a wider one
                c.observe_forward(x, padded, a + b * x + pad * padded)
        for m, per in (draft or {}).items():
            for n in (1, 2, 4):
                for rows in (1, 2):
                    c.observe_proposal(m, n, rows, per * n)
    return c


def test_forward_fit_separates_tokens_from_padding_and_keeps_a_prior_slope_when_x_never_varies():
    c = _costs(pad=0.0003)
    intercept, per_token, per_pad = c.forward.coefficients()
    assert intercept == pytest.approx(0.030, rel=0.05) and per_token == pytest.approx(0.0006, rel=0.1)
    assert per_pad == pytest.approx(0.0003, rel=0.15)
    flat = OnlineLinear(2, forward_prior)
    assert not flat.known
    for _ in range(50):
        flat.observe((4, 4), 0.05)
    _, slope, pad = flat.coefficients()
    assert flat(4, 4) == pytest.approx(0.05, rel=0.05) and 0 < slope + pad < 0.05 * 0.05
    # a long prefill first, then decode steps of 1 token: the intercept is the decode cost, never 0
    mixed = OnlineLinear(2, forward_prior)
    mixed.observe((60, 0), 0.090)
    for _ in range(20):
        mixed.observe((1, 1), 0.027)
    assert mixed.coefficients()[0] == pytest.approx(0.027, rel=0.1)


def test_costs_never_fall_with_work():
    """Noise that would fit a negative slope is refit with that slope held at 0."""
    m = OnlineLinear(2, proposer_prior)
    for x, y in [(1, 0.010), (4, 0.006)] * 20:
        m.observe((x, x), y)
    intercept, slope, per_row = m.coefficients()
    assert slope == 0.0 and per_row == 0.0 and 0.006 < intercept < 0.010
    two = OnlineLinear(2, forward_prior)  # one slope negative, then the other once the first is held at 0
    for t, p, y in [(1, 1, 0.060), (5, 5, 0.058), (4, 16, 0.059), (8, 32, 0.057)] * 20:
        two.observe((t, p), y)
    assert min(two.coefficients()) >= 0.0 and two(1, 1) == pytest.approx(0.0585, rel=0.05)


def test_a_proposer_intercept_and_row_cost_are_learned_from_varied_calls():
    """A draft that first catches up (8 ms) and then drafts 2 ms per position plus 0.5 ms per position and row: the
    fit finds all three, so a longer proposal is not priced as if each position carried the catch-up, and a call for
    4 rows is not priced like one for 32."""
    m = OnlineLinear(2, proposer_prior)
    for _ in range(20):
        for n in (1, 2, 4):
            for rows in (1, 4, 16):
                m.observe((n, n * rows), 0.008 + 0.002 * n + 0.0005 * n * rows)
    intercept, per_position, per_row = m.coefficients()
    assert intercept == pytest.approx(0.008, rel=0.1) and per_position == pytest.approx(0.002, rel=0.1)
    assert per_row == pytest.approx(0.0005, rel=0.1)


def test_the_step_prediction_is_logged_against_the_measurement():
    c = StepCosts()
    for i in range(40):
        c.observe_proposal("draft", 2, 1, 0.004)
        c.observe_forward(4, 4, 0.030 * (1.2 if i % 2 else 1.0))
    s = c.log.summary()
    assert s["steps"] == 39 and 0.05 < s["median_abs_error"] < 0.15


def test_a_cost_the_model_lacks_shows_as_one_kind_of_steps_bias():
    """Tree steps dearer by a fixed 10 ms that no feature carries: the overall fit absorbs it, but per kind the
    tree steps are underpredicted and the plain ones overpredicted."""
    c = StepCosts()
    for i in range(200):
        tree = i % 2 == 1
        tokens = 4 + 4 * (i // 2 % 4)  # both kinds over the same widths
        c.observe_forward(tokens, tokens, 0.030 + 0.001 * tokens + (0.010 if tree else 0.0), "tree" if tree else "plain")
    kinds = c.log.summary()["by_kind"]
    assert kinds["tree"]["median_measured_over_predicted"] > 1.05
    assert kinds["plain"]["median_measured_over_predicted"] < 0.95


def test_tracker_estimates_per_position_and_starts_from_the_population():
    t = AcceptanceTracker(4)
    assert t.survival("a", "draft") == pytest.approx([0.5 ** j for j in range(1, 5)])  # a coin flip per position
    for _ in range(40):
        t.observe("a", "draft", 4, 1)  # first draft always accepted, second always rejected
    rates = t.rates("a", "draft")
    assert rates[0] > 0.95 and rates[1] < 0.05 and rates[2] == pytest.approx(0.5)  # position 3 never observed
    assert t.rates("b", "draft")[0] > 0.95  # a new request starts from its population
    t.forget("a")
    assert t.rates("a", "draft") == t.rates("b", "draft")


def test_a_request_moves_off_its_population_within_a_few_steps_and_drifts_back_when_idle():
    t = AcceptanceTracker(2)
    for i in range(200):  # the population: first draft accepted 80% of the time
        t.observe(f"w{i}", "draft", 1, int(i % 5 != 0))
    pop = t.rates("new", "draft")[0]
    assert pop == pytest.approx(0.8, abs=0.05)
    for _ in range(4):
        t.observe("a", "draft", 1, 0)  # this request's drafts all fail
    low = t.rates("a", "draft")[0]
    assert low < 0.4
    for _ in range(10):
        t.idle_step("a")  # it stopped speculating: its evidence fades, its population's comes back
    assert t.rates("a", "draft")[0] > 0.65 and t.idle["a"] == 10


def test_trees_and_chains_follow_the_same_rule():
    """A tree method's slot j is node j (best first): its survival is estimated directly, kept non-increasing;
    three misses move a rare-hit node's estimate as much as they move a chain's, relative to the evidence weight
    (no per-method rates)."""
    t = AcceptanceTracker(6, tree_methods=frozenset({"medusa"}))
    assert t.survival("a", "medusa") == pytest.approx([0.5 ** j for j in range(1, 7)])
    for _ in range(80):  # nodes 1 and 2 are siblings at depth 1 (node 2 always wins), node 5 is node 2's child
        t.observe("a", "medusa", 5, 2, path=[0, 2, 5])
    s = t.survival("a", "medusa")
    assert s[0] > 0.95 * s[1]  # kept non-increasing: node 1 (listed first) is never estimated below node 2
    assert s[5] <= s[4]
    for i in range(200):  # a population whose first node is right 1 step in 4
        hit = i % 4 == 0
        t.observe(f"w{i}", "medusa", 1, int(hit), path=[0, 1] if hit else [0])
    for _ in range(3):
        t.observe("b", "medusa", 1, 0, path=[0])
    assert 0.05 < t.survival("b", "medusa")[0] < t.survival("new", "medusa")[0]
    assert PRIOR_WEIGHT > 0


def test_plan_speculates_fully_when_it_pays_and_not_at_all_when_it_does_not():
    costs = _costs(draft={"draft": 0.002})
    base = StepBase(2, 2, 2)
    good = [Row([0.9, 0.81, 0.73, 0.66], 4, "draft")] * 2
    assert plan(good, base, costs) == [4, 4]
    bad = [Row([0.05, 0.0025, 0.0001, 0.0], 4, "draft")] * 2
    assert plan(bad, base, costs) == [0, 0]
    dear = _costs(draft={"draft": 0.05})  # good acceptance, but a draft position costs more than a target forward
    assert plan(good, base, dear) == [0, 0]


def test_a_per_step_proposer_intercept_is_charged_once():
    """A draft that costs 10 ms per call plus 1 ms per position pays at k = 4 (4 x 0.7 survival) but would not if the
    10 ms were charged per position, which is what the old per-position median did after k = 1 steps."""
    costs = _costs(a=0.030, b=0.0006)
    for _ in range(30):
        for n in (1, 2, 4):
            costs.observe_proposal("draft", n, 1, 0.010 + 0.001 * n)
    rows = [Row([0.7, 0.49, 0.34, 0.24], 4, "draft")]
    assert plan(rows, StepBase(1, 1, 1), costs) == [4]


def test_padding_makes_uniform_lengths_pay_where_one_long_row_does_not():
    """16 rows, one with a long good streak: on a machine where padded slots cost, lifting one row to k = 4 pads the
    other 15 too, so the plan keeps it shorter than it would without padding."""
    rows = [Row([0.95, 0.9, 0.85, 0.8], 4, "ngram")] + [Row([0.02, 0.0, 0.0, 0.0], 4, "ngram")] * 15
    base = StepBase(16, 16, 16)
    free_pad = plan(rows, base, _costs(a=0.060, b=0.001))
    dear_pad = plan(rows, base, _costs(a=0.060, b=0.001, pad=0.0006))
    assert free_pad[0] == 4 and dear_pad[0] < 4
    assert all(k == 0 for k in free_pad[1:] + dear_pad[1:])


def test_plan_trims_rows_whose_slots_do_not_pay_and_probes_idle_ones():
    costs = _costs(a=0.010, b=0.002)  # verify work is expensive per token here
    rows = [Row([0.95, 0.9, 0.85, 0.8], 4, "ngram"), Row([0.01, 0.0, 0.0, 0.0], 4, "ngram"),
            Row([0.01, 0.0, 0.0, 0.0], 4, "ngram", probe=True)]
    base = StepBase(3, 3, 3)
    ks = plan(rows, base, costs)
    assert ks[0] >= 3 and ks[1] == 0 and ks[2] == 1
    assert goodput(rows, ks, base, costs) > goodput(rows, [0, 0, 0], base, costs)
    assert PROBE_EVERY > 1


def test_plan_before_any_measurement_proposes_the_caps():
    assert plan([Row([0.1] * 4, 3, "draft"), Row([0.1] * 4, 0, "draft")], StepBase(2, 2, 2), StepCosts()) == [3, 0]


def test_a_per_step_cost_is_paid_once_whatever_the_tree_size():
    """Medusa's heads cost the same for 3 nodes or 16: charged per position, a wide tree looks 16x dearer than it is
    and the plan stays small; charged once, the plan takes the nodes whose survival pays for their verify rows."""
    costs = _costs(a=0.040, b=0.001)
    for _ in range(30):
        costs.observe_proposal("medusa", 1, 1, 0.004)
    survival = [0.3, 0.15, 0.1, 0.08, 0.06, 0.05, 0.04, 0.03] + [0.02] * 8
    rows = [Row(survival, 16, "medusa")]
    base = StepBase(1, 1, 1)
    per_step = plan(rows, base, costs, frozenset({"medusa"}))
    per_position = plan(rows, base, costs)
    assert per_position[0] < per_step[0]
    assert all(s >= 0.02 for s in survival[: per_step[0]])  # every node kept is worth its verify row


def test_a_population_key_refines_a_method_and_keeps_its_own_evidence():
    """n-gram matches of different lengths are different populations: evidence for "ngram/4" moves neither
    "ngram/2" nor the request's own estimate under "ngram/2"; both feed the method's pool, an unseen length's
    prior; a tree method's refinements are trees too."""
    t = AcceptanceTracker(2, tree_methods=frozenset({"ngram"}))
    for _ in range(20):
        t.observe("r", "ngram/4", 2, 2, [0, 1, 2])
        t.observe("r", "ngram/2", 2, 0, [0])
    assert t.population("ngram/4")[0] > 0.9 and t.population("ngram/2")[0] < 0.1
    assert t.rates("r", "ngram/4")[0] > 0.9 and t.rates("r", "ngram/2")[0] < 0.1
    assert t.population("ngram/3") == t.population("ngram")  # never seen: the method's pool, which both fed
    assert 0.4 < t.population("ngram")[0] < 0.6 and AcceptanceTracker(2).population("ngram/3") == [0.5, 0.5]
    t.forget("r")
    assert t.rates("r", "ngram/4") == t.population("ngram/4")


def _plan_one_step(population):
    """An AdaptiveController planning two decoding auto requests whose populations `population` names."""
    from types import SimpleNamespace

    from specserve.engine.spec_decode.controller import AdaptiveController

    c = AdaptiveController(4, frozenset(), frozenset(), 2048)
    c.costs = _costs(a=0.010, b=0.002)
    for _ in range(30):  # strong matches are accepted, weak ones are not
        c.tracker.observe("old", "ngram/4", 4, 4)
        c.tracker.observe("old", "ngram/2", 1, 0)
    reqs = [SimpleNamespace(request_id=i, method="ngram", adaptive=True, num_speculative_tokens=4,
                            num_computed_tokens=9, token_ids=list(range(10)), planned_k=None) for i in "abc"]
    c.plan(reqs, population)
    return c, [r.planned_k for r in reqs]


def test_the_plan_drafts_long_for_strong_matches_and_not_at_all_without_one():
    keys = {"a": "ngram/4", "b": "ngram/2", "c": None}
    c, ks = _plan_one_step(lambda r: keys[r.request_id])
    assert ks[0] >= 3 and ks[1] == 0 and ks[2] == 0
    c.observe_verified("a", "ngram", ks[0], 0, None)  # what the plan assumed is what the verdict updates
    assert c.tracker.rates("a", "ngram/4")[0] < c.tracker.population("ngram/4")[0] + 1e-9
    assert c.tracker.rates("a", "ngram/2") == c.tracker.population("ngram/2")  # nor another length's
    _, unrefined = _plan_one_step(None)  # without keys every row shares the method's (unseen) population
    assert unrefined == [unrefined[0]] * 3
