"""SamplingParams validation: every out-of-range field raises InvalidRequestError naming that field."""

import pytest

from specserve.engine.errors import InvalidRequestError
from specserve.engine.sampling_params import SamplingParams


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.01),
    ("temperature", -1.0),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.01),
    ("top_k", -2),
    ("top_k", -100),
    ("min_p", -0.1),
    ("min_p", 1.5),
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("logprobs", 21),
    ("logprobs", -1),
    ("presence_penalty", 2.01),
    ("presence_penalty", -2.5),
    ("frequency_penalty", 2.5),
    ("frequency_penalty", -2.01),
    ("stop", [""]),
    ("stop", ["ok", ""]),
    ("stop", ""),
    ("num_speculative_tokens", -1),
])
def test_out_of_range_raises_with_param(field, value):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field
    assert isinstance(info.value, ValueError)  # a 4xx for the server, a ValueError for Python callers
    assert field in str(info.value)


@pytest.mark.parametrize("field, value", [
    ("temperature", 0.0),
    ("temperature", 5.0),
    ("top_p", 1.0),
    ("top_p", 1e-6),
    ("top_k", 0),
    ("top_k", 1),
    ("min_p", 0.0),
    ("min_p", 1.0),
    ("max_tokens", 1),
    ("max_tokens", None),
    ("logprobs", 0),
    ("logprobs", 20),
    ("logprobs", None),
    ("presence_penalty", 2.0),
    ("presence_penalty", -2.0),
    ("frequency_penalty", 2.0),
    ("frequency_penalty", -2.0),
    ("num_speculative_tokens", 0),
    ("num_speculative_tokens", None),
])
def test_boundary_values_are_accepted(field, value):
    assert getattr(SamplingParams(**{field: value}), field) == value


def test_stop_string_becomes_a_list():
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop=["a", "bc"]).stop == ["a", "bc"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams().stop == []


def test_top_k_minus_one_means_off():
    assert SamplingParams(top_k=-1).top_k == 0


def test_greedy_and_penalty_flags():
    assert SamplingParams(temperature=0.0).greedy and not SamplingParams(temperature=0.01).greedy
    assert not SamplingParams().has_penalties
    assert SamplingParams(presence_penalty=0.1).has_penalties
    assert SamplingParams(frequency_penalty=-0.1).has_penalties


def test_defaults_are_not_shared_between_instances():
    a, b = SamplingParams(), SamplingParams()
    a.stop.append("x")
    assert b.stop == []
