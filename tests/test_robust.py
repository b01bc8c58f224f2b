"""Robust aggregation (``aggregation``) and simulated attacks (``attack``): each rule against an aggregate
computed by hand, the config's one-line refusals, the attackers' replies, and short in-process federations
where an attack moves a mean-aggregated model and not a median-aggregated one."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from fedbr_flwr.core import attack
from fedbr_flwr.core.config import check_trim_cuts, validate
from fedbr_flwr.core.errors import ConfigError
from fedbr_flwr.server.robust import (
    JudgedGroup,
    RobustRule,
    RoundPlan,
    clip_scales,
    coordinate_median,
    krum_scores,
    krum_select,
    minimum_updates,
    pooled_distances,
    squared_distances,
    trimmed_count,
    trimmed_mean,
)
from fedbr_flwr.server.updates import named_mean

W = "model/w"


def updates(*values):
    return [{W: np.asarray(v, dtype=np.float32)} for v in values]


def aggregate(rule: RobustRule, ups, weights=None, reference=None):
    reference = reference if reference is not None else {W: np.zeros_like(ups[0][W])}
    plan = rule.plan(ups, reference)
    return plan, plan.combine(ups, weights or [1.0] * len(ups), [W], relative_to=reference)[W]


# ---------------------------------------------------------------- the rules, by hand


def test_median_of_an_even_count_is_the_mean_of_the_middle_two():
    stack = np.array([[1.0, 0.0], [4.0, 7.0], [2.0, -1.0], [10.0, 3.0]])
    np.testing.assert_array_equal(coordinate_median(stack), [3.0, 1.5])  # (2 + 4) / 2, (0 + 3) / 2
    _, out = aggregate(RobustRule("median"), updates([1, 0], [4, 7], [2, -1], [10, 3]))
    np.testing.assert_array_equal(out, [3.0, 1.5])
    assert out.dtype == np.float32


def test_trimmed_mean_cuts_floor_fraction_n_at_each_end():
    stack = np.array([[1.0], [2.0], [3.0], [4.0], [100.0]])
    assert trimmed_mean(stack, 0.2)[0] == 3.0  # 1 and 100 cut: (2 + 3 + 4) / 3
    assert trimmed_mean(stack, 0.39)[0] == 3.0  # floor(1.95) = 1 cut at each end
    assert trimmed_mean(stack, 0.19)[0] == 22.0  # floor(0.95) = 0: the plain mean
    assert trimmed_count(100, 0.29) == 29  # 0.29 * 100 is 28.999... in binary
    plan, out = aggregate(RobustRule("trimmed-mean", trim=0.4), updates([-50], [2], [3], [4], [60]))
    assert out[0] == 3.0  # two cut at each end
    assert plan.record([5, 6, 7, 8, 9]) == {"rule": "trimmed-mean", "cut": 2}
    assert plan.record([5, 6]) == {"rule": "trimmed-mean", "cut": 0}  # what rounds.jsonl says of a thin round


def test_krum_score_sums_the_n_minus_f_minus_2_closest_squared_distances():
    flat = np.array([[0.0], [1.0], [2.0], [3.0], [100.0]])
    # f = 1: 2 neighbours each. 0: 1 + 4; 1: 1 + 1; 2: 1 + 1; 3: 1 + 4; 100: 97^2 + 98^2
    np.testing.assert_array_equal(krum_scores(squared_distances(flat), 1), [5.0, 2.0, 2.0, 5.0, 97.0**2 + 98.0**2])
    assert krum_select(squared_distances(flat), 1, 1) == [1]  # a tie: the lower index
    assert krum_select(squared_distances(flat), 1, 4) == [0, 1, 2, 3]
    plan, out = aggregate(RobustRule("krum", byzantine=1), updates([0], [1], [2], [3], [100]))
    assert out[0] == 1.0 and plan.record([10, 11, 12, 13, 14]) == {"rule": "krum", "selected": [11]}
    _, out = aggregate(RobustRule("multi-krum", byzantine=1), updates([0], [1], [2], [3], [100]), [1, 1, 1, 5, 1])
    assert out[0] == pytest.approx((0 + 1 + 2 + 15) / 8)  # multi-krum's mean is weighted
    with pytest.raises(ValueError, match="more than 2f"):
        krum_scores(squared_distances(flat[:4]), 1)
    assert minimum_updates("krum", 1) == 5 and minimum_updates("median", 3) == 3 and minimum_updates("mean", 3) == 1


def test_norm_bound_clips_each_update_relative_to_the_global_model():
    g = {W: np.array([1.0, 1.0], dtype=np.float32)}
    ups = updates([4, 5], [1, 2])  # updates (3, 4), norm 5, and (0, 1), norm 1
    np.testing.assert_allclose(clip_scales(np.array([5.0, 1.0, 0.0]), 2.0), [0.4, 1.0, 1.0])
    plan, out = aggregate(RobustRule("norm-bound", bound=2.0), ups, reference=g)
    # (1 + 0.4 * (3, 4) + (1, 2)) / 2 = ((2.2, 2.6) + (1, 2)) / 2
    np.testing.assert_allclose(out, [1.6, 2.3], rtol=1e-6)
    assert plan.record([7, 8]) == {"rule": "norm-bound", "bound": 2.0, "clipped": [7]}
    # bound 0: a multiple of the median norm (norms 5, 1, 2: the median 2, x 1.5 = 3)
    plan, out = aggregate(RobustRule("norm-bound", multiple=1.5), updates([4, 5], [1, 2], [1, 3]), [1, 1, 2], g)
    assert plan.bound == pytest.approx(3.0)
    np.testing.assert_allclose(out, (np.array([1 + 1.8, 1 + 2.4]) + [1, 2] + 2 * np.array([1, 3])) / 4, rtol=1e-6)
    # changes (relative_to None: from zero) outside any judged group are clipped by the same scales
    delta = [{"d": np.array([10.0], np.float32)}, {"d": np.array([2.0], np.float32)}]
    assert plan.combine(delta[:2], [1, 1], ["d"])["d"][0] == pytest.approx((0.6 * 10 + 2) / 2)


def test_norm_bound_of_a_round_most_clients_leave_unchanged_is_0_and_keeps_the_model():
    """Most updates 0 (clients that return the model they were sent): the median norm, and so the bound, is 0, which
    leaves an unchanged update as it is (scale 1, not 0 / 0, NaN, as a mutant had it) and clips any other to 0."""
    g = {W: np.array([1.0, 2.0], dtype=np.float32)}
    plan, out = aggregate(RobustRule("norm-bound"), updates([1, 2], [1, 2], [9, 9]), reference=g)
    assert plan.bound == 0.0 and plan.scales == (1.0, 1.0, 0.0)
    np.testing.assert_array_equal(out, g[W])
    np.testing.assert_array_equal(clip_scales(np.array([0.0, 0.0, 3.0]), 0.0), [1.0, 1.0, 0.0])


def test_krum_judges_the_other_arrays_a_strategy_averages_in_their_own_scale():
    """A client whose model update Krum would keep, but whose control-variate change is far from the others'."""
    model = np.array([[0.0], [1.0], [2.0], [3.0], [100.0]])
    other = np.array([[0.0], [50.0], [1.0], [2.0], [3.0]])
    # 2 neighbours each (f = 1). Each group's Krum scores alone: model 5, 2, 2, 5, 97^2 + 98^2; other 5, 4513, 2,
    # 2, 5: both have the median 5, by which each group's squared distances are divided before they are summed
    want = np.array([(4 + 1) + (9 + 4), (4 + 2304) + (1 + 2401), (1 + 1) + (4 + 1), (1 + 1) + (9 + 4), 0]) / 5
    want[4] = ((9409 + 1) + (9604 + 4)) / 5
    np.testing.assert_allclose(krum_scores(pooled_distances([model, other], 1), 1), want)
    assert krum_select(squared_distances(model), 1, 1) == [1]  # on the model alone: client 1
    ups = [{W: m.astype(np.float32), "d": o.astype(np.float32)} for m, o in zip(model, other)]
    plan = RobustRule("krum", byzantine=1).plan(ups, {W: np.zeros(1, np.float32)}, [JudgedGroup(("d",))])
    assert plan.selected == (2,)


def test_krum_judges_a_group_that_most_clients_leave_unchanged_by_its_distances_alone():
    """Where most clients return the same values in a judged group (SCAFFOLD's first control-variate changes, equal
    DisTrans offsets), its median Krum score is 0: its distances then count as they are, not divided by 0 (NaN
    scores, and a choice of clients by NaN order, as a mutant had it)."""
    model = np.array([[0.0], [1.0], [2.0], [3.0], [100.0]])
    same = np.zeros((5, 1))
    typical = 5.0  # the model's median Krum score, by which its distances are divided (as in the test above)
    np.testing.assert_allclose(pooled_distances([model, same], 1), squared_distances(model) / typical)
    other = same.copy()
    other[4] = 7.0  # one client's change differs: its squared distance, 49, to each other, not scaled
    pooled = pooled_distances([model, other], 1)
    np.testing.assert_allclose(pooled, squared_distances(model) / typical + squared_distances(other))
    ups = [{W: m.astype(np.float32), "d": o.astype(np.float32)} for m, o in zip(model, other)]
    plan = RobustRule("krum", byzantine=1).plan(ups, {W: np.zeros(1, np.float32)}, [JudgedGroup(("d",))])
    assert plan.selected == (1,)  # as on the model alone


def test_norm_bound_clips_each_judged_group_by_its_own_bound_too():
    g = {W: np.array([1.0, 1.0], dtype=np.float32)}
    ups = updates([4, 5], [1, 2], [1, 1.5])  # model updates of norm 5, 1, 0.5: scales 0.4, 1, 1 under a bound of 2
    for u, d, t in zip(ups, [20.0, 2.0, 1.0], [10.0, 2.0, 1.5]):
        u.update({"d": np.array([d], np.float32), "t": np.array([t], np.float32)})
    judged = [JudgedGroup(("d",)), JudgedGroup(("t",), centred=True)]
    plan = RobustRule("norm-bound", bound=2.0, multiple=2.0).plan(ups, g, judged)
    # d, from zero: norms 20, 2, 1, bound 2 x median = 4: own scales 0.2, 1, 1 (and at most the model's)
    assert plan.combine(ups, [1, 1, 1], ["d"])["d"][0] == pytest.approx((0.2 * 20 + 2 + 1) / 3)
    # t, centred on the median 2: distances 8, 0, 0.5, bound 2 x 0.5 = 1: scales 1/8, 1, 1
    assert plan.combine(ups, [1, 1, 1], ["t"])["t"][0] == pytest.approx(2 + (8 / 8 + 0 - 0.5) / 3)
    np.testing.assert_allclose(plan.combine(ups, [1, 1, 1], [W], g)[W], [1 + 1.2 / 3, 1 + (1.6 + 1 + 0.5) / 3])
    assert plan.record([7, 8, 9])["clipped"] == [7]
    t_only = RobustRule("norm-bound", bound=10.0, multiple=2.0).plan(ups, g, judged)  # no model update clipped
    assert t_only.scales == (1.0, 1.0, 1.0) and t_only.record([7, 8, 9])["clipped"] == [7]
    ups[0]["d"] = np.array([2.0], np.float32)  # d's own scales 1, 1, 1: the first client's is its model's 0.4
    plan = RobustRule("norm-bound", bound=2.0, multiple=2.0).plan(ups, g, judged)
    assert plan.combine(ups, [1, 1, 1], ["d"])["d"][0] == pytest.approx((0.4 * 2 + 2 + 1) / 3)


def test_mean_plan_is_named_mean_bit_for_bit():
    rng = np.random.default_rng(3)
    ups = [{W: rng.normal(size=(5, 3)).astype(np.float32)} for _ in range(4)]
    got = RoundPlan().combine(ups, [1, 2, 3, 4], [W])[W]
    assert got.tobytes() == named_mean(ups, [1, 2, 3, 4], [W])[W].tobytes()


# ---------------------------------------------------------------- the config's refusals


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"aggregation": "trimmed-mean", "trim-fraction": 0.5}, "must be in [0, 0.5)"),
        ({"aggregation": "median", "weighting": "samples"}, "aggregation=median has no weighted form"),
        ({"aggregation": "trimmed-mean", "num-clients": 3}, "= 0 values at each end of the 3 clients"),
        ({"aggregation": "trimmed-mean", "num-clients": 20, "fraction-fit": 0.4}, "at least 0.13, or sample more"),
        ({"aggregation": "trimmed-mean", "num-clients": 2, "trim-fraction": 0.4}, "sample at least 3 clients a round"),
        (
            {"aggregation": "median", "num-clients": 4, "fraction-fit": 0.5},
            "the 2 clients sampled a round is their mean",
        ),
        # one sampled client: every round had fewer updates than the median needs, and kept the model
        ({"aggregation": "median", "num-clients": 1}, "over the 1 client sampled a round is their mean"),
        ({"aggregation": "norm-bound", "num-clients": 1}, "sample at least 3, or set norm-bound"),
        ({"aggregation": "krum", "strategy": "groupdro"}, "groupdro weighs clients by its own rule"),
        ({"aggregation": "krum", "num-clients": 4}, "needs n > 2f + 2, i.e. at least 5 clients a round, but 4"),
        ({"aggregation": "multi-krum", "num-clients": 10, "fraction-fit": 0.5, "byzantine-clients": 2}, "at least 7"),
        ({"attack": "sign-flip"}, "needs the attackers"),
        ({"attack-clients": 2}, "attack = none"),
        ({"attack-arrays": "all"}, "attack-arrays are set but attack = none"),
        ({"attack": "label-flip", "attack-ids": "1", "attack-arrays": "all"}, "label-flip sends its reply as trained"),
        ({"attack": "scale", "attack-clients": 1, "attack-ids": "0"}, "not both"),
        ({"attack": "scale", "attack-ids": "0,x"}, "must be partition ids"),
        ({"attack": "scale", "attack-ids": ","}, "must be partition ids"),  # an attack by no client ran
        ({"attack": "scale", "attack-ids": "0,3, 0"}, "names a client twice"),  # a typo: 2 attackers, not 3
        ({"attack": "noise", "attack-ids": "3", "num-clients": 3}, "among the 3 clients"),
    ],
)
def test_config_refuses_with_one_line(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        validate(overrides)
    assert "\n" not in str(e.value)


def test_the_trim_fraction_a_refusal_suggests_cuts_a_value_of_each_end():
    for sampled in range(3, 400):
        with pytest.raises(ConfigError) as e:
            check_trim_cuts(0.0, sampled)
        suggested = float(re.search(r"at least ([0-9.]+)", str(e.value)).group(1))
        assert trimmed_count(sampled, suggested) >= 1 and suggested < 0.5, sampled
    validate({"aggregation": "trimmed-mean", "num-clients": 10})  # the default 0.1 cuts one of ten


def test_weighted_rules_take_samples_weighting():
    for rule in ("mean", "multi-krum", "norm-bound"):
        validate({"aggregation": rule, "weighting": "samples"})


# ---------------------------------------------------------------- the attackers


def test_attackers_from_ids_or_a_seeded_count():
    cfg = validate({"attack": "sign-flip", "attack-ids": "4, 1", "num-clients": 10})
    assert attack.attackers(cfg) == [1, 4]
    drawn = validate({"attack": "sign-flip", "attack-clients": 3, "num-clients": 10})
    assert len(attack.attackers(drawn)) == 3 and attack.attackers(drawn) == attack.attackers(dict(drawn))
    assert attack.attackers(drawn) != attack.attackers({**drawn, "seed": 1}) or True  # seeded, repeatable
    assert attack.attackers(validate({"num-clients": 10})) == []


def test_poisoned_replies_by_hand():
    sent = {W: np.array([1.0, 1.0], np.float32), "model/n": np.array(3), "head/b": np.array([0.0], np.float32)}
    reply = {W: np.array([2.0, 3.0], np.float32), "model/n": np.array(5), "head/b": np.array([1.0], np.float32)}
    reply["control-delta/w"] = np.array([7.0], np.float32)
    base = {"num-clients": 4, "attack-ids": "2", "attack-factor": 10.0}

    def poison(kind, pid=2, **extra):
        return attack.poisoned(reply, sent, validate({**base, "attack": kind, **extra}), 3, pid)

    flipped = poison("sign-flip")
    np.testing.assert_array_equal(flipped[W], [1 - 10 * 1, 1 - 10 * 2])
    np.testing.assert_array_equal(flipped["head/b"], [-10.0])
    assert flipped["model/n"] == 5 and flipped["control-delta/w"][0] == 7.0  # counters and changes as trained
    assert flipped[W].dtype == np.float32
    np.testing.assert_array_equal(poison("scale", **{"attack-factor": 3.0})[W], [1 + 3 * 1, 1 + 3 * 2])
    assert poison("sign-flip", pid=1) is reply  # not an attacker
    assert poison("label-flip") is reply  # attacks through its training labels
    both = validate({**base, "attack": "collude", "attack-ids": "1,2"})
    one, two = (attack.poisoned(reply, sent, both, 3, pid) for pid in (1, 2))
    np.testing.assert_array_equal(one[W], two[W])  # colluders send the same update
    noisy = validate({**base, "attack": "noise", "attack-ids": "1,2", "attack-noise": 0.5})
    a, b = (attack.poisoned(reply, sent, noisy, 3, pid) for pid in (1, 2))
    assert not np.array_equal(a[W], b[W]) and np.abs(a[W] - 1).max() < 5


def test_attack_arrays_all_poisons_the_returned_arrays_as_changes_from_zero():
    sent = {W: np.array([1.0, 1.0], np.float32), "model/n": np.array(3)}
    reply = {W: np.array([2.0, 3.0], np.float32), "model/n": np.array(5)}
    reply["control-delta/w"] = np.array([7.0], np.float32)
    base = {"num-clients": 4, "attack-ids": "2", "attack-factor": 10.0}

    def poison(kind, arrays):
        return attack.poisoned(reply, sent, validate({**base, "attack": kind, "attack-arrays": arrays}), 3, 2)

    flipped = poison("sign-flip", "all")
    np.testing.assert_array_equal(flipped["control-delta/w"], [-70.0])  # 0 - 10 * (7 - 0)
    np.testing.assert_array_equal(flipped[W], poison("sign-flip", "model")[W])
    assert flipped["model/n"] == 5 and flipped["control-delta/w"].dtype == np.float32
    noisy, model_only = poison("noise", "all"), poison("noise", "model")
    np.testing.assert_array_equal(noisy[W], model_only[W])  # the model's draw comes first in both
    assert model_only["control-delta/w"][0] == 7.0 and noisy["control-delta/w"][0] != 7.0


def test_label_flippers_train_on_flipped_labels():
    from fedbr_flwr.data.dataset import load_client_data

    cfg = validate({"num-clients": 3, "test-fraction": 0.05})
    honest = load_client_data(cfg, 1, "cpu")
    flipper = load_client_data({**cfg, "attack": "label-flip", "attack-ids": "1"}, 1, "cpu")
    assert torch.equal(flipper.y_train, 9 - honest.y_train)
    assert torch.equal(flipper.y_test, honest.y_test) and torch.equal(flipper.x_train, honest.x_train)


# ---------------------------------------------------------------- composing with the algorithms' server steps


def strategy_with_updates(tmp_path, strategy, rule, num_clients=4, count=3, **extra):
    """The strategy under ``rule``, a round's global arrays, and updates of ``count`` clients around them."""
    from fedbr_flwr.app.server_app import build_strategy
    from fedbr_flwr.server.updates import ClientUpdate

    settings = {"strategy": strategy, "aggregation": rule, "num-clients": num_clients, "model": "cnn-small"}
    cfg = validate(settings | extra)
    s = build_strategy({**cfg, "output-dir": str(tmp_path)})
    g = s.initial_arrays()
    rng = np.random.default_rng(0)
    returned = {n: np.zeros(shape, np.float32) for n, shape in s.returned_shapes().items()}

    def moved(a):
        return (a + rng.normal(size=a.shape)).astype(a.dtype) if a.dtype.kind == "f" else a

    ups = [
        ClientUpdate(
            pid,
            {**{n: moved(a) for n, a in g.items()}, **{n: moved(a) for n, a in returned.items()}},
            10,
        )
        for pid in range(count)
    ]
    return s, g, ups


def round_of(s, g, ups):
    """The round ``s.aggregate`` gets: ``ups`` around ``g``, equal weights, the rule's plan for them."""
    from fedbr_flwr.server.robust import AggregationRound

    plan = s.robust_rule.plan([u.arrays for u in ups], g, s.judged_groups())
    return AggregationRound(1, g, ups, [1.0] * len(ups), plan)


def median_of(ups, name):
    return np.median(np.stack([u.arrays[name].astype(np.float64) for u in ups]), axis=0)


def test_scaffold_moves_its_control_by_the_rules_aggregate(tmp_path):
    s, g, ups = strategy_with_updates(tmp_path, "scaffold", "median")
    new = s.aggregate(round_of(s, g, ups))
    key = next(iter(s.control))
    want = 3 / 4 * median_of(ups, f"control-delta/{key}")  # c = 0 + |S| / N * median of the changes
    np.testing.assert_allclose(s.control[key], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new[f"model/{key}"], median_of(ups, f"model/{key}"), rtol=1e-5, atol=1e-6)


def test_feddyn_takes_the_drift_from_the_rules_aggregate(tmp_path):
    s, g, ups = strategy_with_updates(tmp_path, "feddyn", "median")
    name = next(n for n in g if g[n].dtype.kind == "f")
    new = s.aggregate(round_of(s, g, ups))
    alpha = s.settings.alpha
    med = median_of(ups, name)
    h = -alpha / 4 * 3 * (med - g[name])
    np.testing.assert_allclose(s.h[name], h, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(new[name], med - h / alpha, rtol=1e-4, atol=1e-5)


def test_feddyn_drift_under_multi_krum_is_the_sum_over_the_kept_clients_whatever_their_weights(tmp_path):
    """Multi-Krum's aggregate is a weighted mean under weighting=samples: |kept| times its distance from w was not
    the sum FedDyn's h takes."""
    from fedbr_flwr.server.robust import AggregationRound

    s, g, ups = strategy_with_updates(tmp_path, "feddyn", "multi-krum", 5, 5, weighting="samples")
    weights = [10.0, 20.0, 30.0, 40.0, 50.0]
    rnd = AggregationRound(1, g, ups, weights, s.robust_rule.plan([u.arrays for u in ups], g))
    s.aggregate(rnd)
    name = next(n for n in g if g[n].dtype.kind == "f")
    drift = sum(u.arrays[name].astype(np.float64) - g[name] for u in rnd.used)
    assert len(rnd.used) == 4
    np.testing.assert_allclose(s.h[name], -s.settings.alpha / 5 * drift, rtol=1e-4, atol=1e-6)


def test_scaffold_control_under_multi_krum_is_the_sum_over_the_kept_clients_whatever_their_weights(tmp_path):
    """c moves by the sum of the kept clients' Delta c_i over N, as FedDyn's h: weighted by sample counts under
    weighting=samples, Multi-Krum's mean of them was not that sum."""
    from fedbr_flwr.server.robust import AggregationRound

    s, g, ups = strategy_with_updates(tmp_path, "scaffold", "multi-krum", 5, 5, weighting="samples")
    weights = [10.0, 20.0, 30.0, 40.0, 50.0]
    rnd = AggregationRound(1, g, ups, weights, s.robust_rule.plan([u.arrays for u in ups], g, s.judged_groups()))
    s.aggregate(rnd)
    key = next(iter(s.control))
    kept = sum(u.arrays[f"control-delta/{key}"].astype(np.float64) for u in rnd.used)
    assert len(rnd.used) == 4
    np.testing.assert_allclose(s.control[key], kept / 5, rtol=1e-4, atol=1e-6)


def test_distrans_avg_sends_the_rules_aggregate_offset(tmp_path):
    from strategies.distrans import OffsetAggregator

    s, g, ups = strategy_with_updates(tmp_path, "distrans", "krum", 5, 5, **{"distrans-agg": "avg"})
    ups[3].arrays = {n: a.copy() for n, a in ups[1].arrays.items()}
    ups[4].arrays = {n: a + 100 if a.dtype.kind == "f" else a for n, a in ups[2].arrays.items()}
    s.aggregator = OffsetAggregator("avg", np.full((5, 10), 0.2))
    rnd = round_of(s, g, ups)
    s.aggregate(rnd)
    assert rnd.plan.selected in ((1,), (3,))  # the two identical updates score lowest
    np.testing.assert_array_equal(s.next_offsets[0], ups[1].arrays["offset"])


@pytest.mark.parametrize("rule", ["krum", "multi-krum", "norm-bound"])
@pytest.mark.parametrize("strategy", ["scaffold", "distrans"])
def test_an_honest_model_update_carries_no_poisoned_control_or_offset(tmp_path, strategy, rule):
    """Krum, multi-Krum and norm-bound judged a client by its model update alone: one client sending another's
    model update (which Krum keeps) with a control-variate change or offset of 1e30 set c, or every client's next
    offset, to about 1e29."""
    from fedbr_flwr.app.strategy import aggregate_accepted
    from strategies.distrans import OffsetAggregator

    extra = {"distrans-agg": "avg"} if strategy == "distrans" else {}
    s, g, ups = strategy_with_updates(tmp_path, strategy, rule, 5, 5, **extra)
    if strategy == "distrans":
        s.aggregator = OffsetAggregator("avg", np.full((5, 10), 0.2))
    for name, a in ups[0].arrays.items():  # client 0 sends client 1's model update: the pair Krum scores lowest
        ups[0].arrays[name] = np.full_like(a, 1e30) if name not in g else ups[1].arrays[name].copy()
    plan, skipped = aggregate_accepted(s, 1, ups)  # as the server does it
    assert not skipped and (rule == "norm-bound" or 0 not in plan.used(5))
    moved = s.control.values() if strategy == "scaffold" else s.next_offsets.values()
    assert max(float(np.abs(a).max()) for a in moved) < 10


@pytest.mark.parametrize(
    ("rule", "extra", "fewest"),
    [
        ("median", {}, 3),
        ("trimmed-mean", {"trim-fraction": 0.2}, 5),
        ("norm-bound", {}, 3),
        ("norm-bound", {"norm-bound": 2.0}, 1),
        ("krum", {}, 5),
    ],
)
def test_a_robust_rule_leaves_the_model_unchanged_when_failures_leave_it_too_few_updates(tmp_path, rule, extra, fewest):
    """The configuration refuses a median of 2 sampled clients, but a round of 3 with one failed took the mean of
    the other two, one of them 1e30 everywhere; trimmed-mean then cut nothing, and norm-bound's median norm was
    the attacker's half."""
    from fedbr_flwr.app.strategy import aggregate_accepted

    s, g, ups = strategy_with_updates(tmp_path, "fedavg", rule, 5, 5, **extra)
    assert s.robust_rule.fewest_updates() == fewest
    s.sent = g
    ups[0].arrays = {n: np.full_like(a, 1e30) if a.dtype.kind == "f" else a for n, a in ups[0].arrays.items()}
    _, skipped = aggregate_accepted(s, 1, ups[: fewest - 1])
    if fewest > 1:
        assert skipped and all(np.array_equal(s.latest[n], g[n]) for n in g)
    _, skipped = aggregate_accepted(s, 2, ups[:fewest])
    assert not skipped
    assert max(float(np.abs(a).max()) for a in s.latest.values() if a.dtype.kind == "f") < 1e3


def test_a_fixed_norm_bound_needs_three_updates_where_it_judges_arrays_beside_the_model(tmp_path):
    """Those are bounded by a multiple of their median size: of two updates the mean, so one client's Delta c_i
    of 1e30 was only halved (2.5e29 in c), and a round's one valid update passed whole."""
    from fedbr_flwr.app.strategy import aggregate_accepted

    with pytest.raises(ConfigError, match="bounds scaffold's arrays beside the model .* sample at least 3"):
        validate({"strategy": "scaffold", "aggregation": "norm-bound", "norm-bound": 1.0, "num-clients": 2})
    distrans = {"strategy": "distrans", "aggregation": "norm-bound", "norm-bound": 1.0, "num-clients": 2}
    with pytest.raises(ConfigError, match="bounds distrans's arrays beside the model .* sample at least 3"):
        validate({**distrans, "distrans-agg": "avg"})
    for agg in ("auto", "nn", "none"):  # no offset is averaged (auto chooses none or nn)
        validate({**distrans, "distrans-agg": agg})
    s, g, ups = strategy_with_updates(tmp_path, "scaffold", "norm-bound", 3, 3, **{"norm-bound": 1.0})
    s.sent = g
    for name in s.delta_names():
        ups[1].arrays[name] = np.full_like(ups[1].arrays[name], 1e30)
    _, skipped = aggregate_accepted(s, 1, ups[:2])  # the third failed
    assert skipped and max(float(np.abs(c).max()) for c in s.control.values()) == 0
    _, skipped = aggregate_accepted(s, 2, ups)
    assert not skipped and max(float(np.abs(c).max()) for c in s.control.values()) < 10


def test_scaffold_keeps_its_control_variate_when_finite_changes_would_sum_past_float32(tmp_path):
    """Under the mean, one client's finite control changes of 3e38 a round took the server's c to Inf in the
    fourth round, and Inf was sent to every client from then on."""
    from fedbr_flwr.app.strategy import aggregate_accepted

    s, g, ups = strategy_with_updates(tmp_path, "scaffold", "mean", 3, 3)
    s.sent = g
    for name in s.delta_names():
        ups[1].arrays[name] = np.full_like(ups[1].arrays[name], 3e38)
    for server_round in range(1, 6):
        _, skipped = aggregate_accepted(s, server_round, ups)
        assert not skipped and all(np.isfinite(c).all() for c in s.control.values())
    assert max(float(np.abs(c).max()) for c in s.control.values()) == pytest.approx(3e38, rel=1e-3)


@pytest.mark.parametrize("strategy", ["feddyn", "fedcm"])
def test_feddyn_and_fedcm_keep_their_state_when_finite_updates_would_take_it_past_float32(tmp_path, strategy):
    """Two clients' models of 3e38 took FedDyn's h (a float32 sum) and of -3e38 FedCM's direction (over lr K < 1)
    to Inf: every later update was NaN and rejected, and no round trained again."""
    from fedbr_flwr.app.strategy import aggregate_accepted

    s, g, ups = strategy_with_updates(tmp_path, strategy, "mean", 3, 3)
    s.sent = g
    for u in ups[:2]:
        u.arrays = {n: np.full_like(a, 3e38 if strategy == "feddyn" else -3e38) for n, a in u.arrays.items()}
    for server_round in (1, 2):
        s.round_arrays(server_round, s.sent)  # FedCM's round start
        _, skipped = aggregate_accepted(s, server_round, ups)
        state = s.h.values() if strategy == "feddyn" else s.components[0].delta.values()
        assert not skipped and all(np.isfinite(a).all() for a in (*state, *s.latest.values()))
    warnings = [json.loads(line) for line in (tmp_path / "progress.jsonl").read_text().splitlines()]
    assert [w["round"] for w in warnings if "would hold Inf: " in w["message"]] == [1, 2]


def test_norm_bound_relative_to_the_median_refuses_two_sampled_clients():
    with pytest.raises(ConfigError, match="sample at least 3, or set norm-bound"):
        validate({"aggregation": "norm-bound", "num-clients": 2})
    validate({"aggregation": "norm-bound", "num-clients": 2, "norm-bound": 1.0})


def test_groupdro_under_multi_krum_believes_only_the_losses_of_the_clients_it_keeps(tmp_path):
    """A client reporting a first-step loss of 1e6 took all of p whether multi-Krum kept it or not; in a round that
    dropped it, the kept clients' weights summed to 0 and averaging them raised out of the server."""
    from fedbr_flwr.app.strategy import aggregate_accepted

    s, g, ups = strategy_with_updates(tmp_path, "groupdro", "multi-krum", 5, 5)
    honest = {n: a.copy() for n, a in ups[1].arrays.items()}
    far = {n: a + 100 if a.dtype.kind == "f" else a for n, a in ups[0].arrays.items()}
    for u in ups:
        u.metrics = {"first-loss": 1e6 if u.pid == 0 else 1.0 + u.pid / 10}
    ups[0].arrays = far
    plan, _ = aggregate_accepted(s, 1, ups)  # dropped: its loss moves nothing
    p = s.client_weights.p
    assert plan.used(5) == (1, 2, 3, 4) and p[0] < p[1] < p[2] < p[3] < p[4]
    assert p[1] / p[0] == pytest.approx(np.exp(s.settings.eta * 1.1))
    ups[0].arrays = honest  # client 1's update: kept, and its loss takes the whole weight
    plan, _ = aggregate_accepted(s, 2, ups)
    assert 0 in plan.used(5) and s.client_weights.p[0] == 1.0
    ups[0].arrays = far  # dropped again: the kept clients are weighed by their ratios, which p lost to underflow
    plan, skipped = aggregate_accepted(s, 3, ups)
    assert not skipped and plan.used(5) == (1, 2, 3, 4)
    assert all(np.isfinite(a).all() for a in s.latest.values())


def test_distrans_records_only_the_offsets_of_the_clients_krum_keeps(tmp_path):
    """A client Krum drops goes on from the offset it had (its update is not used), and the server's record of
    its latest offset, which the global test and offsets.npz read, keeps that one too."""
    from strategies.distrans import OffsetAggregator

    s, g, ups = strategy_with_updates(tmp_path, "distrans", "krum", 5, 5, **{"distrans-agg": "none"})
    s.aggregator = OffsetAggregator("none", np.full((5, 10), 0.2))
    before = {pid: np.full(s.returned_shapes()["offset"], pid, np.float32) for pid in range(5)}
    s.returned_offsets = dict(before)
    rnd = round_of(s, g, ups)
    s.aggregate(rnd)
    (kept,) = rnd.plan.selected
    for u in ups:
        want = u.arrays["offset"] if u.pid == kept else before[u.pid]
        np.testing.assert_array_equal(s.returned_offsets[u.pid], want)


def test_distrans_global_test_sees_the_median_offset_under_a_robust_rule(tmp_path):
    """The mean of the clients' latest offsets, which one offset of 1e30 made the global test's input."""
    s, _, _ = strategy_with_updates(tmp_path, "distrans", "norm-bound", **{"distrans-agg": "none"})
    s.returned_offsets = {
        pid: np.full(s.returned_shapes()["offset"], v, np.float32) for pid, v in enumerate([0, 1, 1e30])
    }
    np.testing.assert_array_equal(s.global_test_module().t.cpu().numpy(), s.returned_offsets[1])


@pytest.mark.parametrize("rule, count", [("median", 3), ("krum", 5)])
def test_distrans_nn_fits_the_kept_offsets_clipped_to_the_range_it_outputs(tmp_path, rule, count):
    """One offset of 1e30 (finite, well-formed) made the network, and so every client's next offset, NaN."""
    from strategies.distrans import OffsetAggregator

    s, g, ups = strategy_with_updates(tmp_path, "distrans", rule, count, count, **{"distrans-agg": "nn"})
    ups[1].arrays["offset"] = np.full_like(ups[1].arrays["offset"], 1e30)
    s.aggregator = OffsetAggregator("nn", np.eye(count, 10, dtype=np.float32), s.network)
    fitted: dict = {}
    fit = s.aggregator.fit
    s.aggregator.fit = lambda offsets: (fitted.update(offsets), fit(offsets))[1]
    rnd = round_of(s, g, ups)
    s.aggregate(rnd)
    low = (s.network.center - s.network.half_range).numpy()
    high = (s.network.center + s.network.half_range).numpy()
    assert sorted(fitted) == [ups[i].pid for i in rnd.plan.used(count)]
    for pid, target in fitted.items():  # an offset inside the range is fitted as it came
        np.testing.assert_array_equal(target, np.clip(ups[pid].arrays["offset"], low, high))
    for offset in s.next_offsets.values():
        assert np.isfinite(offset).all() and (offset >= low - 1e-6).all() and (offset <= high + 1e-6).all()


# ---------------------------------------------------------------- short federations


FED = {
    "strategy": "fedavg",
    "num-clients": 5,
    "num-rounds": 6,
    "local-steps": 10,
    "batch-size": 16,
    "eval-every": 6,
    "global-test": True,
    "test-fraction": 0.05,
    "model": "cnn-small",
    "rotate": False,
    "partition": "iid",
    "lr": 0.1,
}


def federated(tmp_path, num_clients=FED["num-clients"], **overrides):
    """A 6-round in-process FedAvg federation (5 clients unless told): its last evaluation and its rounds.jsonl
    lines."""
    from fakes import in_process_federation, run_rounds

    torch.set_num_threads(1)
    cfg = validate({**FED, "num-clients": num_clients, **overrides})
    strategy, _, proxies = in_process_federation(cfg, tmp_path)
    run_rounds(strategy, proxies, cfg["num-rounds"])
    evals = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rounds = [json.loads(line) for line in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    return evals[-1]["global_acc"], rounds, manifest


def test_one_sign_flipper_breaks_the_mean_and_not_the_median(tmp_path):
    """1 of 5 clients sends its update x -10: the mean lands near chance, the median near the honest run."""
    honest, _, _ = federated(tmp_path / "honest")
    attacked = {"attack": "sign-flip", "attack-ids": "2"}
    broken, rounds, manifest = federated(tmp_path / "mean", **attacked)
    robust, robust_rounds, _ = federated(tmp_path / "median", aggregation="median", **attacked)
    assert honest > 0.3, honest
    assert broken < honest - 0.15, (broken, honest)
    assert robust > honest - 0.07, (robust, honest)
    assert manifest["attack"] == {"kind": "sign-flip", "clients": [2], "factor": 10.0, "noise": 1.0, "arrays": "model"}
    assert all(r["attackers"] == [2] for r in rounds) and "aggregation" not in rounds[0]
    assert robust_rounds[0]["aggregation"] == {"rule": "median"}


def test_a_client_scaling_its_control_variate_change_moves_the_mean_and_not_norm_bound(tmp_path):
    """With attack-arrays=all one client of five sends its Delta c_i scaled x 1e6 too (with the model only, c is
    the honest run's): the mean's server c follows it, norm-bound's stays near the honest run's."""

    def control_norm(name, **overrides):
        _, rounds, _ = federated(tmp_path / name, strategy="scaffold", **{"num-rounds": 1, **overrides})
        return rounds[-1]["server"]["control-norm"]

    attacked = {"attack": "scale", "attack-ids": "2", "attack-factor": 1e6}
    honest = control_norm("honest")
    assert control_norm("model-only", **attacked) == pytest.approx(honest, rel=1e-5)  # its Delta c_i as trained
    assert control_norm("mean", **attacked, **{"attack-arrays": "all"}) > 1e4 * honest
    assert control_norm("norm-bound", aggregation="norm-bound", **attacked, **{"attack-arrays": "all"}) < 3 * honest
