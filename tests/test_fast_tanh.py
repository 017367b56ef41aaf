"""The approximate tanh (``controller.fast_tanh``) and the decisions taken on it: every
float32 sampled stays within ``TANH_ERROR`` of numpy's; ``evaluate`` with it gives, row for
row, the decision the exact forward gives each stream's grid alone (local mode's), on
drawn policies, observations, masks and near ties; without the recheck of near ties some
decision differs (so the parity test can fail)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("numba")

from controller import fast_tanh
from controller.decider import evaluate
from controller.policy_file import ExportedPolicy
from env.features import FeatureSpec
from env.guard import NO_GUARD

SPEC = FeatureSpec()
ROWS = len(SPEC.batch_grid)


def test_kernel_within_its_bound_on_a_sample_of_float32() -> None:
    rng = np.random.default_rng(0)
    bits = rng.integers(0, 2**32, size=2_000_000, dtype=np.uint64).astype(np.uint32)
    dense = np.linspace(-10, 10, 400_001, dtype=np.float32)  # where tanh bends
    # every float32 in [1, 2) and its negatives (the range reduction's k = 1..3)
    one_two = np.arange(0x3F800000, 0x40000000, 16, dtype=np.uint32).view(np.float32)
    x = np.concatenate([bits.view(np.float32), dense, one_two, -one_two,
                        np.float32([0.0, -0.0, 1e-38, -1e-45, 8.99, 9.0, 9.01, 88.0,
                                    np.inf, -np.inf, np.nan])])
    got = fast_tanh.tanh_inplace(x.copy())
    want = np.tanh(x)
    nan = np.isnan(x)
    assert np.isnan(got[nan]).all()
    assert np.abs(got[~nan].astype(np.float64) - want[~nan]).max() <= fast_tanh.TANH_ERROR
    assert np.abs(got[~nan]).max() <= 1.0


def test_unsure_streams_marks_near_ties_nans_and_no_finite_best() -> None:
    tol = 1e-3
    logits = np.tile(np.array([1.0, 0.5, 0.0, -0.5]), (2 * 3, 1))  # 0 leads by 0.5
    assert not fast_tanh.unsure_streams(logits, 3, tol).any()
    for row, change, expect in ((4, (1, 1.0), [False, True]),  # a tie
                                (1, (2, 1.0 - 0.5 * tol), [True, False]),  # within tol
                                (1, (1, 1.0 - 2 * tol), [False, False]),  # beyond
                                (5, (3, np.nan), [False, True]),
                                (2, (0, -np.inf), [False, False]),  # second best stays
                                ):
        case = logits.copy()
        case[row, change[0]] = change[1]
        assert fast_tanh.unsure_streams(case, 3, tol).tolist() == expect, (row, change)
    blocked = logits.copy()
    blocked[0] = -np.inf  # no action allowed: no finite best
    assert fast_tanh.unsure_streams(blocked, 3, tol).tolist() == [True, False]
    assert fast_tanh.unsure_streams(logits.astype(np.float32), 2, tol).tolist() == [
        False, False, False]


def test_tolerance_grows_with_the_weights() -> None:
    small = ExportedPolicy.random(seed=0)
    big = ExportedPolicy(weights=[w * 3 for w in small.weights], biases=small.biases,
                         actions=small.actions, feature_spec=small.feature_spec)
    assert 0 < small.tanh_tolerance < big.tanh_tolerance
    # two hidden layers: the error enters twice, through the last two weight matrices
    w1, w2 = (np.abs(w.astype(np.float64)).sum(axis=0).max() for w in small.weights[1:])
    assert small.tanh_tolerance == pytest.approx(
        2 * w2 * fast_tanh.TANH_ERROR * (1 + w1))


def exact_per_stream(policy: ExportedPolicy, grids: np.ndarray, allowed) -> np.ndarray:
    """Each stream's decision alone on the exact forward: local mode's, today's."""
    saved = fast_tanh.ENABLED
    fast_tanh.ENABLED = False
    try:
        return np.stack([evaluate(policy, grids[i:i + 1], [allowed[i]], None, None,
                                  NO_GUARD)[0][0] for i in range(len(grids))])
    finally:
        fast_tanh.ENABLED = saved


def near_tie_policy(seed: int, scale: float, hidden: int, gap: float,
                    spread: float = 0.0) -> ExportedPolicy:
    """A random policy whose last two actions' logits nearly tie in every row: their
    output columns equal but for a random ``spread``, their biases ``gap`` apart."""
    base = ExportedPolicy.random(SPEC, hidden=(hidden, hidden), seed=seed)
    weights = [w * np.float32(scale) for w in base.weights]
    biases = [b.copy() for b in base.biases]
    noise = np.random.default_rng(seed).normal(0.0, spread, size=hidden)
    weights[-1][:, -1] = weights[-1][:, -2] + noise.astype(np.float32)
    biases[-1][-1] = biases[-1][-2] + np.float32(gap)
    return ExportedPolicy(weights=weights, biases=biases, actions=base.actions,
                          feature_spec=SPEC)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**16), scale=st.sampled_from([0.3, 1.0, 2.0, 4.0]),
       hidden=st.sampled_from([16, 64, 128]), streams=st.integers(3, 9),
       gap=st.sampled_from([None, 0.0, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3]),
       spread=st.sampled_from([0.0, 1e-7, 1e-6, 1e-5]), masked=st.booleans())
def test_decisions_are_the_exact_forwards(seed, scale, hidden, streams, gap, spread,
                                          masked) -> None:
    rng = np.random.default_rng(seed)
    if gap is None:
        base = ExportedPolicy.random(SPEC, hidden=(hidden, hidden), seed=seed)
        policy = ExportedPolicy(weights=[w * np.float32(scale) for w in base.weights],
                                biases=base.biases, actions=base.actions, feature_spec=SPEC)
    else:
        policy = near_tie_policy(seed, scale, hidden, gap, spread)
    grids = rng.uniform(-1.5, 1.5, size=(streams, ROWS, SPEC.size)).astype(np.float32)
    allowed = [None if not masked or rng.random() < 0.3
               else rng.random(len(policy.actions)) < 0.6 for _ in range(streams)]
    index, _, _ = evaluate(policy, grids, allowed, None, None, NO_GUARD)
    np.testing.assert_array_equal(index, exact_per_stream(policy, grids, allowed))
    assert index.dtype == np.intp  # the daemon reads the indices' bytes as intp


def test_one_or_two_streams_are_decided_on_the_exact_forward(monkeypatch) -> None:
    """Local mode (and a daemon's poll of one or two streams) never takes the approximate
    path; three streams do."""
    policy = ExportedPolicy.random(seed=4)
    grids = np.random.default_rng(4).uniform(-1, 1, size=(3, ROWS, SPEC.size)).astype(
        np.float32)
    calls = []
    original = ExportedPolicy.approximate_logits
    monkeypatch.setattr(ExportedPolicy, "approximate_logits",
                        lambda self, x: calls.append(len(x)) or original(self, x))
    index, _, _ = evaluate(policy, grids[:1], [None], None, None, NO_GUARD)
    assert calls == []
    assert index.dtype == np.intp  # the daemon reads the indices' bytes as intp
    evaluate(policy, grids[:2], [None, None], None, None, NO_GUARD)
    assert calls == []
    evaluate(policy, grids, [None] * 3, None, None, NO_GUARD)
    assert calls == [3 * ROWS]


def test_without_the_recheck_near_ties_would_differ(monkeypatch) -> None:
    """The recheck is what keeps the parity above: with a tolerance below zero (nothing
    rechecked) the approximate logits decide some near tie the other way."""
    differed = 0
    for seed in range(40):
        policy = near_tie_policy(seed, 2.0, 64, 0.0, 1e-6)
        grids = np.random.default_rng(seed).uniform(
            -1.5, 1.5, size=(8, ROWS, SPEC.size)).astype(np.float32)
        want = exact_per_stream(policy, grids, [None] * 8)
        np.testing.assert_array_equal(
            evaluate(policy, grids, [None] * 8, None, None, NO_GUARD)[0], want)
        policy.__dict__["tanh_tolerance"] = -1.0  # the cached property, overridden
        differed += int((evaluate(policy, grids, [None] * 8, None, None, NO_GUARD)[0]
                         != want).sum())
    assert differed > 0


def test_turned_off_uses_the_exact_forward(monkeypatch) -> None:
    policy = ExportedPolicy.random(seed=3)
    x = np.random.default_rng(3).uniform(-1, 1, size=(ROWS, SPEC.size)).astype(np.float32)
    assert policy.approximate_logits(x) is not None
    monkeypatch.setattr(fast_tanh, "ENABLED", False)
    assert policy.approximate_logits(x) is None
    relu = ExportedPolicy(weights=policy.weights, biases=policy.biases,
                          actions=policy.actions, feature_spec=SPEC, activation="relu")
    monkeypatch.setattr(fast_tanh, "ENABLED", True)
    assert relu.approximate_logits(x) is None


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bit for bit, any NaN equal to any NaN."""
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b))
                and np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32)))


def test_fused_bias_and_tanh_are_the_unfused_pair_bit_for_bit() -> None:
    """bias_tanh_inplace(x, b) is numpy's float32 x + b then tanh_inplace, bit for bit, on
    drawn bit patterns, biases and the kernel's edges (benchmarks/bias_tanh_equal.py checks
    all 2^32 float32 with a zero bias)."""
    rng = np.random.default_rng(7)
    width = 64
    edges = np.float32([0.0, -0.0, 1e-38, -1e-45, 4.49, 4.5, 4.51, 8.99, 9.0, 88.0,
                        3e38, -3e38, np.inf, -np.inf, np.nan])
    cases = [rng.integers(0, 2**32, size=(4096, width), dtype=np.uint64)
             .astype(np.uint32).view(np.float32),
             (rng.standard_normal((2048, width)) * 4).astype(np.float32),
             np.resize(edges, (len(edges), width))]
    for x in cases:
        for bias in (np.zeros(width, dtype=np.float32),
                     (rng.standard_normal(width) * 2).astype(np.float32),
                     np.resize(edges, width).astype(np.float32)):
            with np.errstate(invalid="ignore", over="ignore"):
                want = x + bias
            fast_tanh.tanh_inplace(want)
            got = fast_tanh.bias_tanh_inplace(x.copy(), bias)
            assert same_bits(want, got)


@pytest.mark.parametrize("hidden", [(16,), (64, 64), (128, 128)])
def test_approximate_logits_are_the_unfused_forwards_bits(hidden) -> None:
    """The fused forward gives the approximate logits the nineteenth pass's forward gave
    (numpy's bias addition, then the kernel), bit for bit, at every batch shape."""
    from controller.policy_file import _approximate_tanh

    base = ExportedPolicy.random(SPEC, hidden=hidden, seed=len(hidden))
    rng = np.random.default_rng(5)
    # random policies' biases are zero: these are not
    policy = ExportedPolicy(weights=base.weights, actions=base.actions, feature_spec=SPEC,
                            biases=[rng.normal(0.0, 0.5, b.shape).astype(np.float32)
                                    for b in base.biases])
    for rows in (1, ROWS, 3 * ROWS, 64 * ROWS, 5000):
        x = rng.uniform(-1.5, 1.5, size=(rows, SPEC.size)).astype(np.float32)
        want = policy._forward(x, _approximate_tanh)
        assert same_bits(want, policy.approximate_logits(x)), rows


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_decide_rows_is_numpys_argmax_wherever_a_stream_is_sure(dtype) -> None:
    """decide_rows' marks are unsure_streams', and every row of a stream it does not mark
    has numpy's arg-max (rows of marked streams are the caller's to decide again)."""
    rng = np.random.default_rng(11)
    rows, width, streams = 5, 8, 400
    logits = rng.standard_normal((streams * rows, width)).astype(dtype)
    # near ties, exact ties (first or later column), NaN, masked (-inf) and no finite best
    for r in rng.choice(len(logits), size=120, replace=False).tolist():
        a, b = rng.choice(width, size=2, replace=False).tolist()
        kind = r % 5
        if kind == 0:
            logits[r, b] = logits[r].max() + dtype(rng.choice([0.0, 1e-6, 1e-3, 0.1]))
            logits[r, a] = logits[r, b]
        elif kind == 1:
            logits[r, a] = np.nan
        elif kind == 2:
            logits[r, rng.random(width) < 0.7] = -np.inf
        elif kind == 3:
            logits[r] = -np.inf
        else:
            logits[r, a] = logits[r].max() + dtype(0.05)
    for tol in (0.0, 1e-4, 0.02):
        index, unsure = fast_tanh.decide_rows(logits, rows, tol)
        assert index.shape == (streams, rows)
        np.testing.assert_array_equal(unsure, fast_tanh.unsure_streams(logits, rows, tol))
        sure = ~unsure
        assert sure.sum() > streams // 4  # the check compares something
        want = logits.argmax(axis=1).reshape(streams, rows)
        np.testing.assert_array_equal(index[sure], want[sure])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_all_finite_is_numpys_check(dtype) -> None:
    """all_finite (the decider's compiled check of the grids) says what
    ``np.isfinite(x).all()`` says: a NaN, +inf or -inf anywhere (first, last, middle
    entry), none, in contiguous arrays and strided views."""
    rng = np.random.default_rng(5)
    base = rng.standard_normal((6, 9)).astype(dtype)
    cases = [base, base[:, ::2], base[::2]]
    for bad in (np.nan, np.inf, -np.inf):
        for where in ((0, 0), (5, 8), (3, 4)):
            x = base.copy()
            x[where] = bad
            cases += [x, x[:, ::2], x[1:]]
    for x in cases:
        assert fast_tanh.all_finite(x) == bool(np.isfinite(x).all())
    assert sum(not fast_tanh.all_finite(x) for x in cases) > 9  # the bad ones were seen
