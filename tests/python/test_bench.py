"""rd2h.bench reports its percentiles as rd2h's C++ benches and demo report do."""

from rd2h.bench import quantile


def test_quantile_is_the_nearest_rank_as_in_the_cpp_benches():
    # The cases of tests/util/metrics_test.cc (Metrics.QuantileIsTheNearestRank).
    assert quantile([], 0.5) == 0
    assert quantile([5], 0.99) == 5
    assert quantile([4, 1, 3, 2], 0.5) == 2
    hundred = list(range(100, 0, -1))
    assert quantile(hundred, 0.99) == 99
    assert quantile(hundred, 1.0) == 100
