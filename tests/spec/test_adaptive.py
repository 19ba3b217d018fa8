import pytest

from deltaserve.spec.adaptive import STEP_COST, AdaptiveK, AdaptivePolicy, expected_tokens

COSTS = ((1, (1.1, 1.2, 1.3, 1.4)), (64, (1.5, 1.8, 2.1, 2.4)))


def test_expected_tokens_is_one_plus_the_reach_of_each_draft():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens([1.0, 0.0, 1.0], 3) == 2.0


def test_k_maximises_tokens_per_cost():
    ak = AdaptiveK(4, AdaptivePolicy(step_cost=COSTS))
    ak.acceptance = [1.0] * 4
    assert ak.k_for_step(1) == 4                          # 5 / 1.4 beats 4 / 1.3 ...
    ak.acceptance = [0.9, 0.1, 0.9, 0.9]                  # E: 1.9, 1.99, 2.07, 2.14: rates 1.73, 1.66, 1.59, 1.53
    assert ak.k_for_step(1) == 1
    ak.acceptance = [0.3, 0.3, 0.3, 0.3]                  # batch 64: 1.3 / 1.5 < 1: drafts do not pay
    assert ak.best_k(64) == 0 and ak.best_k(1) == 1       # 1.3 / 1.1 > 1 at batch 1


def test_batches_above_the_table_do_not_draft_and_do_not_probe():
    ak = AdaptiveK(4, AdaptivePolicy(step_cost=COSTS, probe_interval=1))
    ak.acceptance = [1.0] * 4
    assert [ak.k_for_step(65) for _ in range(5)] == [0] * 5
    assert ak.k_for_step(64) == 4 and ak.k_for_step(2) == 4   # batch 2 reads the next row up (64)


def test_k_is_capped_by_the_maximum_and_the_table_width():
    ak = AdaptiveK(2, AdaptivePolicy(step_cost=COSTS, prior=1.0))
    assert ak.k_for_step(1) == 2
    ak = AdaptiveK(6, AdaptivePolicy(step_cost=COSTS, prior=1.0))
    assert ak.k_for_step(1) == 4


def test_zero_acceptance_turns_drafts_off_with_rare_probes_and_recovery_brings_them_back():
    ak = AdaptiveK(4, AdaptivePolicy(step_cost=COSTS, probe_interval=8))
    assert ak.k_for_step(1) == 4                          # the prior (0.8) pays
    ks = []
    for _ in range(80):                                   # every first draft rejected
        k = ak.k_for_step(1)
        ks.append(k)
        if k:
            ak.observe([k], [0])
    tail = ks[40:]
    assert tail.count(0) >= 34 and set(tail) == {0, 1}    # off, one probe step in 8
    for _ in range(200):                                  # everything accepted again: probes measure it
        k = ak.k_for_step(1)
        if k:
            ak.observe([k], [k])
    assert ak.k_for_step(1) == 4


def test_pinned_policy_ignores_batch_and_acceptance():
    ak = AdaptiveK(3, AdaptivePolicy.pinned(3))
    ak.acceptance = [0.0] * 3
    assert ak.k_for_step(1) == 3 and ak.k_for_step(10_000) == 3
    assert AdaptiveK(2, AdaptivePolicy.pinned(5)).k_for_step(1) == 2
    assert AdaptiveK(2, AdaptivePolicy.pinned(0)).k_for_step(1) == 0


def test_device_tables_exist_for_both_drafter_kinds():
    for device in ("cuda", "cpu"):
        for method in ("mtp", "ngram"):
            policy = AdaptivePolicy.for_device(device, method)
            assert policy.step_cost == STEP_COST[(device, "mtp" if method == "mtp" else "free")]
    assert AdaptivePolicy.for_device("xpu", "mtp").step_cost == STEP_COST[("cuda", "mtp")]


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
    ({"step_cost": ((16, (1.1,)), (8, (1.2,)))}, "bounds"),
    ({"step_cost": ((0, (1.1,)),)}, "bounds"),
    ({"step_cost": ()}, "bounds"),
    ({"step_cost": ((8, (1.1, 0.0)),)}, "costs"),
    ({"prior": -0.1}, "prior"),
    ({"alpha": 0.0}, "alpha"),
    ({"probe_interval": 0}, "probe_interval"),
    ({"fixed_k": -1}, "fixed_k"),
])
def test_bad_policies_are_refused(kw, key):
    with pytest.raises(ValueError, match=key):
        AdaptivePolicy(**kw)


def test_describe_names_the_costs():
    line = AdaptiveK(3, AdaptivePolicy(step_cost=COSTS)).describe()
    assert "batch<=64: 1.50/1.80/2.10" in line and "K=0" in line
    assert "fixed at 2" in AdaptiveK(3, AdaptivePolicy.pinned(2)).describe()


def test_no_probes_where_even_full_acceptance_cannot_pay():
    ak = AdaptiveK(2, AdaptivePolicy(step_cost=((1, (2.5, 3.5)),), probe_interval=1))
    assert [ak.k_for_step(1) for _ in range(10)] == [0] * 10      # 2 / 2.5 and 3 / 3.5 < 1
    ak.acceptance = [1.0, 1.0]
    assert ak.k_for_step(1) == 0


def test_measured_cuda_costs_turn_free_drafts_on_where_they_pay():
    ak = AdaptiveK(4, AdaptivePolicy.for_device("cuda", "ngram"))
    # the prior 0.8 per position: E(4) = 3.36 against c = 2.02 / 2.06 at batch 1 / 8; above the table, off
    assert [ak.k_for_step(b) for b in (1, 8, 64, 256)] == [4, 4, 0, 0]
    ak.acceptance = [0.3] * 4                   # E(1) = 1.3 < c(B, 1): drafts off (probes aside)
    assert ak.best_k(1) == 0 and ak.best_k(8) == 0
    ak.acceptance = [0.6, 0.2, 0.1, 0.1]        # E(1) = 1.6 / 1.48 beats E(2) = 1.72 / 1.68 at batch 1
    assert ak.best_k(1) == 1


def test_measured_cuda_costs_keep_mtp_drafts_off_short_of_full_acceptance():
    ak = AdaptiveK(4, AdaptivePolicy.for_device("cuda", "mtp"))
    assert [ak.k_for_step(b) for b in (1, 8, 64)] == [0, 0, 0]       # at the prior acceptance
    ak.acceptance = [1.0] * 4                   # all accepted: batch 1 still off (5 / 5.57), batch 8 K = 4 (5 / 4.04)
    assert ak.best_k(1) == 0 and ak.best_k(8) == 4
