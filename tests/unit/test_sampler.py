"""Exact rules of the sampler: per-row parameters, filters, penalties, the exponential race and seeded noise."""

import math

import pytest
import torch

from specserve.engine.sample.sampler import (
    SamplingTensors,
    apply_penalties,
    exponential_noise,
    processed_probs,
    sample,
    uniform_noise,
)
from specserve.engine.sampling_params import SamplingParams

CPU = torch.device("cpu")
# A distribution in scrambled vocabulary order (sorted: 0.5 @2, 0.3 @0, 0.15 @3, 0.05 @1), so the filters'
# sort/scatter must put the kept mass back at the right ids.
P = [0.3, 0.05, 0.5, 0.15]


def _logits(probs, rows=1):
    return torch.tensor([[math.log(p) for p in probs]] * rows)


def _probs(rows: list[SamplingParams], logits, counts=None):
    return processed_probs(logits, SamplingTensors.from_params(rows, CPU), counts)


def _norm(values):
    total = sum(values)
    return torch.tensor([v / total for v in values])


def _close(actual, expected, tol=1e-5):
    assert torch.allclose(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=tol, rtol=0), (actual, expected)


# -- SamplingTensors.from_params ----------------------------------------------------------------------------------

def test_from_params_per_row_values_and_flags():
    rows = [SamplingParams(temperature=0.5, top_k=3, top_p=0.9, min_p=0.1, presence_penalty=0.5,
                           frequency_penalty=-1.0),
            SamplingParams(temperature=0.0, top_k=-1),
            SamplingParams(temperature=2.0)]
    st = SamplingTensors.from_params(rows, CPU)
    assert st.temperature.tolist() == [0.5, 0.0, 2.0]
    assert st.top_k.dtype == torch.long and st.top_k.tolist() == [3, 0, 0]
    _close(st.top_p, [0.9, 1.0, 1.0])
    _close(st.min_p, [0.1, 0.0, 0.0])
    assert st.greedy.tolist() == [False, True, False]
    assert st.presence_penalty.tolist() == [0.5, 0.0, 0.0]
    assert st.frequency_penalty.tolist() == [-1.0, 0.0, 0.0]
    assert (st.all_greedy, st.any_top_k, st.any_top_p, st.any_min_p, st.any_penalty) == (False, True, True, True, True)


def test_from_params_filters_of_greedy_rows_do_not_count_and_penalties_can_be_disabled():
    rows = [SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.5, presence_penalty=1.0),
            SamplingParams(temperature=0.0)]
    st = SamplingTensors.from_params(rows, CPU)
    assert st.all_greedy and not (st.any_top_k or st.any_top_p or st.any_min_p)
    assert st.any_penalty and st.presence_penalty.tolist() == [1.0, 0.0]
    off = SamplingTensors.from_params(rows, CPU, penalties=False)
    assert not off.any_penalty and off.presence_penalty.tolist() == [0.0, 0.0]
    plain = SamplingTensors.from_params([SamplingParams()], CPU)
    assert not (plain.all_greedy or plain.any_top_k or plain.any_top_p or plain.any_min_p or plain.any_penalty)


# -- processed_probs ------------------------------------------------------------------------------------------------

def test_plain_softmax_and_output_sums_to_one():
    out = _probs([SamplingParams()], torch.tensor([[0.0, math.log(2), math.log(4), -math.inf]]))
    assert out.dtype == torch.float32
    _close(out[0], [1 / 7, 2 / 7, 4 / 7, 0.0])


@pytest.mark.parametrize("temperature", [0.5, 2.0, 3.0])
def test_temperature_scales_logits(temperature):
    # softmax(log p / T) ∝ p ** (1 / T)
    out = _probs([SamplingParams(temperature=temperature)], _logits(P))
    _close(out[0], _norm([p ** (1 / temperature) for p in P]))


def test_low_precision_logits_are_accepted():
    out = _probs([SamplingParams()], _logits(P).bfloat16())
    assert out.dtype == torch.float32
    _close(out[0], P, tol=2e-2)


@pytest.mark.parametrize("top_k, kept", [(1, [2]), (2, [2, 0]), (3, [2, 0, 3]), (4, [0, 1, 2, 3]), (9, [0, 1, 2, 3])])
def test_top_k_keeps_the_k_most_likely(top_k, kept):
    out = _probs([SamplingParams(top_k=top_k)], _logits(P))
    _close(out[0], _norm([p if i in kept else 0.0 for i, p in enumerate(P)]))


@pytest.mark.parametrize("top_p, kept", [
    (0.01, [2]),  # the most likely token is always kept, even when its own mass exceeds top_p
    (5e-324, [2]),  # a top_p that is 0 in fp32 (found by the API fuzzer: it dropped every token)
    (0.49, [2]),
    (0.51, [2, 0]),  # 0.5 < 0.51: the next token is needed to reach top_p
    (0.79, [2, 0]),
    (0.81, [2, 0, 3]),
    (0.94, [2, 0, 3]),
    (0.96, [0, 1, 2, 3]),
    (1.0, [0, 1, 2, 3]),
])
def test_top_p_keeps_smallest_set_reaching_top_p(top_p, kept):
    out = _probs([SamplingParams(top_p=top_p)], _logits(P))
    _close(out[0], _norm([p if i in kept else 0.0 for i, p in enumerate(P)]))


def test_top_p_applies_to_the_tempered_distribution():
    # T = 2: p ∝ sqrt(P) = [.294, .120, .379, .208] -> the two largest hold .673 < .7, so three tokens are kept
    # (on the untempered P the two largest already hold .8).
    tempered = [p ** 0.5 for p in P]
    tempered = [t / sum(tempered) for t in tempered]
    assert tempered[2] + tempered[0] < 0.7 < P[2] + P[0]
    out = _probs([SamplingParams(temperature=2.0, top_p=0.7)], _logits(P))
    _close(out[0], _norm([t if i in (2, 0, 3) else 0.0 for i, t in enumerate(tempered)]))


@pytest.mark.parametrize("min_p, kept", [(0.05, [0, 1, 2, 3]), (0.2, [0, 2, 3]), (0.35, [0, 2]), (0.7, [2]),
                                         (1.0, [2])])
def test_min_p_drops_tokens_below_min_p_times_max(min_p, kept):
    # floor = min_p * 0.5: 0.05 -> .025, 0.2 -> .1, 0.35 -> .175, 0.7 -> .35, 1.0 -> .5 (the max itself stays)
    out = _probs([SamplingParams(min_p=min_p)], _logits(P))
    _close(out[0], _norm([p if i in kept else 0.0 for i, p in enumerate(P)]))


def test_top_k_then_top_p_then_min_p_combined():
    # top_k=3 -> [.3, 0, .5, .15]/.95; top_p=.9: .5/.95=.526, +.3/.95 -> .842 < .9 -> all three kept;
    # min_p=.4: floor = .4 * .526 = .21 -> .15/.95 = .158 dropped -> [.3, 0, .5, 0]/.8
    out = _probs([SamplingParams(top_k=3, top_p=0.9, min_p=0.4)], _logits(P))
    _close(out[0], [0.375, 0.0, 0.625, 0.0])


def test_greedy_row_is_one_hot_argmax_in_a_mixed_batch():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.9], [0.1, 2.0, -1.0, 1.9]])
    out = _probs([SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)], logits)
    assert out[0].tolist() == [0.0, 1.0, 0.0, 0.0]
    _close(out[1], torch.softmax(logits[1], -1))


def test_all_greedy_batch_is_one_hot():
    logits = torch.tensor([[0.1, 2.0, -1.0], [5.0, 2.0, -1.0], [0.0, 0.0, 3.0]])
    out = _probs([SamplingParams(temperature=0.0)] * 3, logits)
    assert out.tolist() == [[0, 1, 0], [1, 0, 0], [0, 0, 1]]


def test_each_row_uses_its_own_parameters():
    rows = [SamplingParams(top_k=2), SamplingParams(top_p=0.51), SamplingParams(min_p=0.2),
            SamplingParams(temperature=2.0), SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, top_k=3),
            SamplingParams()]
    out = _probs(rows, _logits(P, rows=len(rows)))
    _close(out[0], _norm([0.3, 0, 0.5, 0]))
    _close(out[1], _norm([0.3, 0, 0.5, 0]))
    _close(out[2], _norm([0.3, 0, 0.5, 0.15]))
    _close(out[3], _norm([p ** 0.5 for p in P]))
    assert out[4].tolist() == [0.0, 0.0, 1.0, 0.0]
    _close(out[5], _norm([0.3 ** 2, 0, 0.5 ** 2, 0.15 ** 2]))
    _close(out[6], P)


def test_penalties_change_probs_only_when_counts_given():
    logits = torch.zeros(2, 3)
    counts = torch.tensor([[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]])
    rows = [SamplingParams(frequency_penalty=math.log(2)), SamplingParams()]
    out = _probs(rows, logits, counts)
    _close(out[0], _norm([1.0, 0.5, 0.25]))  # exp(-log2 * count)
    _close(out[1], [1 / 3] * 3)
    _close(_probs(rows, logits)[0], [1 / 3] * 3)


def test_greedy_row_takes_argmax_after_penalties():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    counts = torch.tensor([[1.0, 0.0, 0.0]])
    out = _probs([SamplingParams(temperature=0.0, presence_penalty=1.0)], logits, counts)
    assert out.tolist() == [[0.0, 1.0, 0.0]]


# -- apply_penalties ------------------------------------------------------------------------------------------------

def test_apply_penalties_openai_rule_per_row():
    rows = [SamplingParams(frequency_penalty=0.5, presence_penalty=1.0),
            SamplingParams(frequency_penalty=-1.0),
            SamplingParams(presence_penalty=2.0),
            SamplingParams()]
    st = SamplingTensors.from_params(rows, CPU)
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]] * 4)
    counts = torch.tensor([[0.0, 1.0, 3.0, 0.0]] * 4)
    out = apply_penalties(logits, counts, st)
    assert out.tolist() == [[1.0, -0.5, -1.5, 1.0],  # 1 - 0.5 * c - 1 * (c > 0)
                            [1.0, 2.0, 4.0, 1.0],  # 1 + c
                            [1.0, -1.0, -1.0, 1.0],  # 1 - 2 * (c > 0)
                            [1.0, 1.0, 1.0, 1.0]]


# -- sample -----------------------------------------------------------------------------------------------------------

def test_exponential_race_is_an_exact_draw():
    n = 200_000
    probs = torch.tensor([0.1, 0.0, 0.2, 0.3, 0.4])
    gen = torch.Generator().manual_seed(1234)
    noise = torch.empty(n, 5).exponential_(generator=gen)
    tokens = sample(probs.expand(n, 5), noise)
    assert tokens.shape == (n,) and tokens.dtype == torch.long
    freq = torch.bincount(tokens, minlength=5).double() / n
    assert freq[1] == 0.0  # a zero-probability token is never drawn
    # standard error <= sqrt(.25 / 2e5) = 0.0011; 0.005 is > 4 sigma, while e.g. argmax(p * E) or argmax(p) is far off
    assert torch.allclose(freq, probs.double(), atol=0.005), freq


def test_sample_accepts_unnormalised_probs_and_one_hot_rows():
    gen = torch.Generator().manual_seed(0)
    n = 100_000
    noise = torch.empty(n, 3).exponential_(generator=gen)
    tokens = sample(torch.tensor([2.0, 6.0, 0.0]).expand(n, 3), noise)
    assert abs((tokens == 1).double().mean().item() - 0.75) < 0.006
    assert (tokens != 2).all()
    noise = torch.empty(50, 4).exponential_(generator=gen)
    onehot = torch.nn.functional.one_hot(torch.arange(50) % 4, 4).float()
    assert sample(onehot, noise).tolist() == (torch.arange(50) % 4).tolist()


# -- exponential_noise / uniform_noise --------------------------------------------------------------------------------

def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_seeded_exponential_rows_do_not_depend_on_the_batch():
    vocab = 11
    alone = exponential_noise([_gen(5)], vocab, _gen(0), CPU)
    batch = exponential_noise([None, _gen(7), _gen(5), None, None], vocab, _gen(99), CPU)
    assert batch.shape == (5, vocab)
    expected5 = torch.empty(vocab).exponential_(generator=_gen(5))
    expected7 = torch.empty(vocab).exponential_(generator=_gen(7))
    assert torch.equal(alone[0], expected5)
    assert torch.equal(batch[2], expected5)
    assert torch.equal(batch[1], expected7)
    assert (batch > 0).all()


def test_unseeded_exponential_rows_come_from_the_default_generator():
    vocab = 7
    default = _gen(3)
    out = exponential_noise([None, _gen(5), None, None], vocab, default, CPU)
    # one draw of [3, V] from the engine's generator, in row order, untouched by the seeded row
    expected = torch.empty(3, vocab).exponential_(generator=_gen(3))
    assert torch.equal(out[[0, 2, 3]], expected)
    # the default generator advanced: the next step's noise differs
    again = exponential_noise([None], vocab, default, CPU)
    assert not torch.equal(again[0], expected[0])
    # and a different engine seed gives different unseeded noise, but the same seeded row
    other = exponential_noise([None, _gen(5), None, None], vocab, _gen(4), CPU)
    assert not torch.equal(other[0], out[0]) and torch.equal(other[1], out[1])


def test_exponential_noise_has_exp1_law():
    out = exponential_noise([None, _gen(1)], 100_000, _gen(2), CPU)
    for row in out:
        assert abs(row.mean().item() - 1.0) < 0.02
        assert abs((row > 1.0).double().mean().item() - math.exp(-1)) < 0.01


def test_seeded_uniform_rows_draw_exactly_their_count():
    width = 6
    alone = uniform_noise([_gen(5)], [3], width, _gen(0), CPU)
    batch = uniform_noise([None, _gen(5), _gen(8), None, _gen(5)], [6, 3, 2, 0, 3], 9, _gen(1), CPU)
    expected = torch.rand(3, generator=_gen(5))
    assert alone.shape == (1, width) and batch.shape == (5, 9)
    assert torch.equal(alone[0, :3], expected)
    assert torch.equal(batch[1, :3], expected)
    assert torch.equal(batch[4, :3], expected)
    assert torch.equal(batch[2, :2], torch.rand(2, generator=_gen(8)))
    assert ((batch >= 0) & (batch < 1)).all()


def test_seeded_uniform_stream_depends_only_on_the_counts():
    # two steps drawing 2 then 3 values continue one stream: the same as drawing 5 at once
    gen = _gen(42)
    first = uniform_noise([None, gen], [4, 2], 4, _gen(0), CPU)
    second = uniform_noise([gen, None, None], [3, 1, 1], 5, _gen(0), CPU)
    stream = torch.rand(5, generator=_gen(42))
    assert torch.equal(first[1, :2], stream[:2])
    assert torch.equal(second[0, :3], stream[2:])


def test_unseeded_uniform_rows_come_from_the_default_generator():
    out = uniform_noise([None, _gen(5), None], [2, 2, 2], 4, _gen(3), CPU)
    expected = torch.rand(3, 4, generator=_gen(3))
    assert torch.equal(out[0], expected[0]) and torch.equal(out[2], expected[2])
    assert uniform_noise([None, None], [0, 0], 0, _gen(0), CPU).shape == (2, 0)


def test_argmax_rows_is_argmax_with_ties_nan_and_odd_shapes():
    from specserve.engine.sample.sampler import ARGMAX_BLOCK, argmax_rows

    g = torch.Generator().manual_seed(0)
    vocab = 8 * ARGMAX_BLOCK
    cases = [torch.randn(5, vocab, generator=g),
             torch.randint(-3, 3, (7, vocab), generator=g).float(),  # many ties: the first maximum wins
             torch.full((2, vocab), float("-inf")),
             torch.randn(3, 2, vocab, generator=g).bfloat16(),  # leading dimensions, half precision
             torch.randn(0, vocab),
             torch.randn(4, vocab + 3, generator=g)]  # not a multiple of the block: torch's argmax
    nan = torch.randn(4, vocab, generator=g)
    nan[0, 5 * ARGMAX_BLOCK + 7] = nan[0, 9] = float("nan")  # the first NaN, in another block than the maximum
    nan[1, 3] = float("inf")
    cases.append(nan)
    for x in cases:
        assert torch.equal(argmax_rows(x), x.argmax(-1))
    tie = torch.zeros(1, vocab)
    tie[0, 3 * ARGMAX_BLOCK + 1] = tie[0, 6 * ARGMAX_BLOCK] = 1.0
    assert argmax_rows(tie).tolist() == [3 * ARGMAX_BLOCK + 1]
