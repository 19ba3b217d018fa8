import pytest

from deltaserve.spec.adaptive import DEFAULT_BATCH_TABLE, AdaptiveK, AdaptivePolicy


def test_large_batches_do_not_draft():
    ak = AdaptiveK(4)
    largest = DEFAULT_BATCH_TABLE[-1][0]
    assert ak.k_for_step(largest + 1) == 0 and ak.k_for_step(4096) == 0
    assert ak.k_for_step(largest) >= 1


def test_table_is_capped_by_the_maximum_and_never_grows_with_batch():
    for max_k in (1, 2, 4):
        ak = AdaptiveK(max_k)
        ks = [ak.k_for_step(b) for b in range(1, 300)]
        assert max(ks) <= max_k and ks == sorted(ks, reverse=True)
    ak = AdaptiveK(2, AdaptivePolicy(batch_table=((8, 5),), min_reach=0.0))
    assert ak.k_for_step(1) == 2 and ak.k_for_step(9) == 0


def test_low_acceptance_shrinks_k_to_one_and_recovery_grows_it_back():
    ak = AdaptiveK(4, AdaptivePolicy(batch_table=((16, 4),)))
    assert ak.k_for_step(1) == 4
    for _ in range(60):                                   # every first draft rejected
        ak.observe([ak.k_for_step(1)] * 8, [0] * 8)
    assert ak.k_for_step(1) == 1                          # position 0 still measured
    for _ in range(60):                                   # everything accepted
        k = ak.k_for_step(1)
        ak.observe([k] * 8, [k] * 8)
    assert ak.k_for_step(1) == 4


def test_reach_threshold_is_the_product_of_earlier_acceptances():
    ak = AdaptiveK(4, AdaptivePolicy(batch_table=((16, 4),), min_reach=0.5))
    ak.acceptance = [0.9, 0.6, 0.9, 0.9]                  # reach: 1, 0.9, 0.54, 0.486
    assert ak.k_for_step(1) == 3
    ak.acceptance = [0.4, 1.0, 1.0, 1.0]                  # reach of position 1: 0.4
    assert ak.k_for_step(1) == 1


def test_observe_counts_only_verified_positions():
    ak = AdaptiveK(3, AdaptivePolicy(prior=0.5, alpha=1.0))
    ak.observe([3], [1])                                  # position 0 accepted, 1 rejected, 2 not verified
    assert ak.acceptance == [1.0, 0.0, 0.5]
    ak.observe([2, 3], [2, 0])                            # row 0: both accepted; row 1: position 0 rejected
    assert ak.acceptance == [0.5, 1.0, 0.5]
    ak.observe([0, 1], [0, 1])                            # a row with no drafts teaches nothing
    assert ak.acceptance == [1.0, 1.0, 0.5]
    with pytest.raises(ValueError, match="accepted"):
        ak.observe([2], [3])


@pytest.mark.parametrize("kw, key", [
    ({"batch_table": ((16, 3), (8, 1))}, "bounds"),
    ({"batch_table": ((0, 3),)}, "bounds"),
    ({"batch_table": ((8, -1),)}, "K values"),
    ({"min_reach": 1.5}, "min_reach"),
    ({"prior": -0.1}, "prior"),
    ({"alpha": 0.0}, "alpha"),
])
def test_bad_policies_are_refused(kw, key):
    with pytest.raises(ValueError, match=key):
        AdaptivePolicy(**kw)


def test_describe_names_the_table():
    line = AdaptiveK(3).describe()
    assert "batch<=16: K=3" in line and "K=0" in line
