"""Arrival processes: seeded, the requested rate and burstiness within statistical
tolerance, and bounded by request count and duration."""

import math

import numpy as np
import pytest

from kvmesh.load_tests.arrivals import ArrivalSpec, arrival_offsets_s, inter_arrival_gaps_s
from kvmesh.core.errors import InvalidRequestError

N = 20_000  # gaps per statistical check: the mean's relative standard error is ~1/sqrt(N*shape)


@pytest.mark.parametrize("rate", [0.5, 4.0, 50.0])
def test_poisson_gaps_have_mean_one_over_rate_and_cv_one(rate):
    gaps = inter_arrival_gaps_s(ArrivalSpec("poisson", rate=rate, seed=1), N)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV = 1


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_keeps_the_rate_and_sets_cv_to_one_over_sqrt_burstiness(burstiness):
    gaps = inter_arrival_gaps_s(ArrivalSpec("gamma", rate=2.0, burstiness=burstiness, seed=2), N)
    assert gaps.mean() == pytest.approx(0.5, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.07)


def test_gamma_with_burstiness_one_is_poisson_in_distribution():
    a = inter_arrival_gaps_s(ArrivalSpec("gamma", rate=3.0, burstiness=1.0, seed=5), N)
    b = inter_arrival_gaps_s(ArrivalSpec("poisson", rate=3.0, seed=6), N)
    assert np.percentile(a, 90) == pytest.approx(np.percentile(b, 90), rel=0.06)


def test_constant_and_infinite_rates():
    assert list(inter_arrival_gaps_s(ArrivalSpec("constant", rate=4.0), 3)) == [0.25, 0.25, 0.25]
    assert list(arrival_offsets_s(ArrivalSpec("poisson", rate=math.inf), 4)) == [0.0, 0.0, 0.0, 0.0]
    assert list(arrival_offsets_s(ArrivalSpec("constant", rate=2.0), 4)) == [0.0, 0.5, 1.0, 1.5]


def test_seeded_streams_repeat_and_differ_by_seed():
    spec = ArrivalSpec("poisson", rate=5.0, seed=11)
    assert np.array_equal(inter_arrival_gaps_s(spec, 100), inter_arrival_gaps_s(spec, 100))
    other = ArrivalSpec("poisson", rate=5.0, seed=12)
    assert not np.array_equal(inter_arrival_gaps_s(spec, 100), inter_arrival_gaps_s(other, 100))


def test_offsets_are_bounded_by_count_and_duration():
    offsets = arrival_offsets_s(ArrivalSpec("poisson", rate=10.0, seed=3, max_requests=50), 1000)
    assert len(offsets) == 50 and offsets[0] == 0.0 and np.all(np.diff(offsets) >= 0)
    offsets = arrival_offsets_s(ArrivalSpec("poisson", rate=10.0, seed=3, duration_s=5.0), 10_000)
    assert offsets.max() < 5.0
    assert len(offsets) == pytest.approx(50, abs=25)  # about rate x duration
    assert len(arrival_offsets_s(ArrivalSpec("poisson", rate=10.0), 7)) == 7  # the workload bounds it


@pytest.mark.parametrize("kwargs", [{"process": "uniform"}, {"rate": 0}, {"rate": -1}, {"burstiness": 0},
                                    {"concurrency": 0}, {"max_requests": 0}, {"duration_s": 0}])
def test_invalid_specs_raise(kwargs):
    with pytest.raises(InvalidRequestError):
        ArrivalSpec(**kwargs).validate()


def test_closed_loop_has_no_arrival_times():
    with pytest.raises(InvalidRequestError):
        inter_arrival_gaps_s(ArrivalSpec("closed", concurrency=4), 10)
    assert ArrivalSpec("closed", concurrency=4).label() == "closed c=4"
