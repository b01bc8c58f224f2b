"""Label partitioners: coverage, determinism, skew vs alpha, sizes, termination, train/test split."""

from __future__ import annotations

import numpy as np
import pytest

from fedbr_flwr.data.partition import (
    dirichlet,
    distributional_heterogeneity,
    label_skew,
    partition,
    partition_hash,
    split_train_test,
)

METHODS = ("fedbr", "dirichlet", "iid", "classes")


def balanced_labels(per_class: int = 100, classes: int = 10, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(classes), per_class))


def unbalanced_labels(seed: int = 0) -> np.ndarray:
    # class 0 holds 900 of 1000 samples; the others hold 5..20 each
    counts = [900, 20, 15, 15, 10, 10, 10, 8, 7, 5]
    return np.random.default_rng(seed).permutation(np.repeat(np.arange(10), counts))


def assert_exact_cover(parts: list[np.ndarray], n: int) -> None:
    allidx = np.sort(np.concatenate(parts))
    np.testing.assert_array_equal(allidx, np.arange(n))
    for p in parts:
        assert p.dtype == np.int64


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("labels_fn", [balanced_labels, unbalanced_labels], ids=["balanced", "unbalanced"])
def test_every_sample_assigned_exactly_once(method, labels_fn):
    labels = labels_fn()
    parts = partition(labels, 10, method, seed=3, alpha=0.5, classes_each=2)
    assert len(parts) == 10
    assert_exact_cover(parts, len(labels))


@pytest.mark.parametrize("method", METHODS)
def test_same_seed_same_partition_different_seed_different_hash(method):
    labels = balanced_labels()
    a = partition(labels, 10, method, seed=7, alpha=0.3, classes_each=2)
    b = partition(labels, 10, method, seed=7, alpha=0.3, classes_each=2)
    c = partition(labels, 10, method, seed=8, alpha=0.3, classes_each=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert partition_hash(a) == partition_hash(b)
    assert partition_hash(a) != partition_hash(c)


def test_partition_hash_depends_on_boundaries():
    # same concatenation, different client boundaries -> different hash
    assert partition_hash([np.array([0, 1]), np.array([2])]) != partition_hash([np.array([0]), np.array([1, 2])])


@pytest.mark.parametrize("method", ["fedbr", "dirichlet"])
def test_skew_grows_as_alpha_falls(method):
    labels = balanced_labels()
    alphas = (100, 1, 0.1, 0.01)
    skews = [
        np.mean([label_skew(labels, partition(labels, 10, method, seed=s, alpha=a)) for s in range(5)]) for a in alphas
    ]
    assert all(x <= y for x, y in zip(skews, skews[1:])), skews
    assert skews[-1] > 0.6, skews
    # fedbr's q ~ Dir(alpha * p) has concentration 10 per class at alpha=100 and clients of 100 samples:
    # its skew stays near an IID split's (about 0.1-0.18), not below 0.15 like the per-class Dirichlet split.
    assert skews[0] < (0.15 if method == "dirichlet" else 0.25), skews
    assert skews[-1] - skews[0] > 0.5, skews


@pytest.mark.parametrize("labels_fn", [balanced_labels, unbalanced_labels], ids=["balanced", "unbalanced"])
@pytest.mark.parametrize("alpha", [1e-4, 0.1, 10.0])
def test_fedbr_even_sizes_and_terminates(labels_fn, alpha):
    labels = labels_fn()
    n, k = len(labels), 7  # 1000 / 7 does not divide: sizes 142 or 143
    for seed in range(3):
        parts = partition(labels, k, "fedbr", seed=seed, alpha=alpha)
        sizes = [len(p) for p in parts]
        assert set(sizes) <= {n // k, n // k + 1}
        assert sum(sizes) == n
        assert_exact_cover(parts, n)


def test_fedbr_tiny_alpha_is_highly_skewed_on_balanced_labels():
    labels = balanced_labels()
    parts = partition(labels, 10, "fedbr", seed=0, alpha=1e-4)
    # most clients hold a single class (the later ones may mix leftovers)
    single = sum(len(np.unique(labels[p])) == 1 for p in parts)
    assert single >= 5


def test_iid_sizes_and_small_skew():
    labels = balanced_labels()
    parts = partition(labels, 7, "iid", seed=1)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert label_skew(labels, parts) < 0.15


@pytest.mark.parametrize("u", [2, 3])
def test_classes_split_holds_exactly_u_labels(u):
    labels = balanced_labels()
    parts = partition(labels, 10, "classes", seed=2, classes_each=u)
    for p in parts:
        assert len(np.unique(labels[p])) == u
    # with 10 clients x u classes over 10 classes, every class has exactly u holders
    for c in range(10):
        holders = [p for p in parts if np.any(labels[p] == c)]
        assert len(holders) == u
        shares = np.array([np.sum(labels[p] == c) for p in holders], dtype=float)
        assert shares.sum() == 100
        # shares ~ U(0.4, 0.6) normalised: ratio at most 0.6 / 0.4, plus slack for int truncation
        assert shares.max() / shares.min() <= 1.5 + 0.1


def test_classes_each_too_large_raises():
    with pytest.raises(ValueError, match="exceeds"):
        partition(balanced_labels(), 10, "classes", seed=0, classes_each=11)


def test_unknown_method_raises():
    with pytest.raises(ValueError, match="unknown partition"):
        partition(balanced_labels(), 10, "shards", seed=0)


def test_distributional_heterogeneity_extremes():
    labels = balanced_labels()
    assert distributional_heterogeneity(labels, partition(labels, 10, "iid", seed=0)) == 0.0
    one_each = partition(labels, 10, "classes", seed=0, classes_each=1)
    assert distributional_heterogeneity(labels, one_each) == 1.0
    two_each = partition(labels, 10, "classes", seed=0, classes_each=2)
    assert distributional_heterogeneity(labels, two_each) == pytest.approx(1 - 20 / 100)


@pytest.mark.parametrize("n", [2, 3, 10, 11, 57, 100])
def test_split_train_test(n):
    indices = np.arange(1000, 1000 + n) * 3
    train, test = split_train_test(indices, 0.2, np.random.default_rng(0))
    expected_test = min(max(int(round(n * 0.2)), 1), n - 1)
    assert len(test) == expected_test
    assert len(train) >= 1 and len(test) >= 1
    assert len(np.intersect1d(train, test)) == 0
    np.testing.assert_array_equal(np.sort(np.concatenate([train, test])), indices)
    assert np.all(np.diff(train) > 0) and np.all(np.diff(test) > 0)


def test_split_train_test_seeded():
    idx = np.arange(50)
    a = split_train_test(idx, 0.2, np.random.default_rng(5))
    b = split_train_test(idx, 0.2, np.random.default_rng(5))
    c = split_train_test(idx, 0.2, np.random.default_rng(6))
    assert np.array_equal(a[1], b[1])
    assert not np.array_equal(a[1], c[1])


def test_dirichlet_terminates_with_more_clients_than_it_can_fill():
    labels = np.arange(100) % 10
    parts = partition(labels, 50, "dirichlet", seed=0, alpha=0.01)
    assert len(parts) == 50
    assert sum(len(p) for p in parts) == 100
    assert_exact_cover(parts, 100)


def test_label_skew_ignores_empty_clients_and_bounds():
    labels = np.repeat(np.arange(2), 5)
    parts = [np.arange(5), np.arange(5, 10), np.zeros(0, np.int64)]
    # each non-empty client holds one of two equal classes: TV = 0.5
    assert label_skew(labels, parts) == pytest.approx(0.5)


class ScriptedRng:
    """A numpy Generator's few draws the partitions make, scripted: what they are given is recorded."""

    def __init__(self, dirichlet):
        self.dirichlet_draw, self.calls = dirichlet, []

    def permutation(self, x):
        return np.asarray(x)

    def dirichlet(self, concentration):
        self.calls.append(("dirichlet", np.asarray(concentration)))
        return np.asarray(self.dirichlet_draw, dtype=float)

    def choice(self, n, p):
        self.calls.append(("choice", np.asarray(p)))
        return int(np.argmax(p))


def test_dirichlet_keeps_the_first_draw_whose_smallest_client_holds_exactly_min_size():
    """Redrawing a partition that already meets min_size moved every later draw of the run's generator."""
    rng = ScriptedRng([0.5, 0.5])
    parts = dirichlet(np.zeros(4, dtype=int), 2, 0.1, rng, min_size=2)  # type: ignore[arg-type]
    assert [len(p) for p in parts] == [2, 2] and len(rng.calls) == 1


def test_an_underflowed_dirichlet_puts_all_mass_on_one_class_drawn_from_the_prior():
    from fedbr_flwr.data.partition import _dirichlet_over_available

    rng = ScriptedRng([np.nan, np.nan])  # tiny concentrations underflow
    q = _dirichlet_over_available(np.array([0.0, 1e-3, 3e-3]), rng)  # type: ignore[arg-type]
    (_, prior) = rng.calls[-1]
    np.testing.assert_allclose(prior, [0.25, 0.75])  # the positive entries' prior, not always the first
    np.testing.assert_array_equal(q, [0.0, 0.0, 1.0])
