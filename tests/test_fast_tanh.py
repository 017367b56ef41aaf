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
       hidden=st.sampled_from([16, 64, 128]), streams=st.integers(1, 9),
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


def test_every_stream_count_takes_the_compiled_forward_where_it_applies(monkeypatch) -> None:
    """The compiled forward (fast_tanh.forward_decide) decides polls of any size; without
    it (here: numpy's sgemm not found) one or two streams take the exact forward and
    three the approximate one, as before it."""
    policy = ExportedPolicy.random(seed=4)
    grids = np.random.default_rng(4).uniform(-1, 1, size=(3, ROWS, SPEC.size)).astype(
        np.float32)
    calls, compiled = [], []
    original = ExportedPolicy.approximate_logits
    monkeypatch.setattr(ExportedPolicy, "approximate_logits",
                        lambda self, x: calls.append(len(x)) or original(self, x))
    original_compiled = ExportedPolicy.compiled_decisions
    monkeypatch.setattr(ExportedPolicy, "compiled_decisions",
                        lambda self, x, rows, masks: compiled.append(len(x))
                        or original_compiled(self, x, rows, masks))
    assert fast_tanh.forward_available()
    for n in (1, 2, 3):
        index, _, _ = evaluate(policy, grids[:n], [None] * n, None, None, NO_GUARD)
        assert index.dtype == np.intp  # the daemon reads the indices' bytes as intp
    assert compiled == [ROWS, 2 * ROWS, 3 * ROWS] and calls == []
    monkeypatch.setattr(fast_tanh, "_forward_ok", False)
    compiled.clear()
    for n in (1, 2, 3):
        index, _, _ = evaluate(policy, grids[:n], [None] * n, None, None, NO_GUARD)
        assert index.dtype == np.intp
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
        # the cached properties, overridden (the compiled forward reads the second, then
        # its second look's bounds: all zero, nothing but underflow's)
        policy.__dict__["tanh_tolerance"] = policy.__dict__["products_tolerance"] = -1.0
        policy.__dict__["_refinement"] = np.zeros_like(policy._refinement)
        differed += int((evaluate(policy, grids, [None] * 8, None, None, NO_GUARD)[0]
                         != want).sum())
    assert differed > 0


def test_turned_off_uses_the_exact_forward(monkeypatch) -> None:
    policy = ExportedPolicy.random(seed=3)
    x = np.random.default_rng(3).uniform(-1, 1, size=(ROWS, SPEC.size)).astype(np.float32)
    assert policy.approximate_logits(x) is not None
    assert policy.compiled_decisions(x, ROWS, None) is not None
    monkeypatch.setattr(fast_tanh, "ENABLED", False)
    assert policy.approximate_logits(x) is None
    assert policy.compiled_decisions(x, ROWS, None) is None
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


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(m=st.integers(2, 70), k=st.integers(2, 130), n=st.integers(2, 130),
       seed=st.integers(0, 2**16), scale=st.sampled_from([1e-3, 1.0, 1e3]))
def test_compiled_products_are_numpys_bit_for_bit(m, k, n, seed, scale) -> None:
    """The kernel's sgemm call is np.dot's own: the same bits (products_tolerance's
    argument takes the first layer's product as the exact forward's)."""
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal((m, k)) * scale).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    assert same_bits(fast_tanh._product_kernel(fast_tanh._SGEMM, a, b), np.dot(a, b))


def never_sure(policy: ExportedPolicy) -> np.ndarray:
    """A second look (forward_refinement's form) whose bounds are too wide to settle any
    row: forward_decide's marks are then the tolerance's alone."""
    return np.full_like(policy._refinement, 1e30)


def approximate_decisions(policy: ExportedPolicy, grids: np.ndarray, masks, tol: float):
    """Per stream: decide_rows on approximate_logits of the stream's grid alone (numpy's
    dot, bias_tanh_inplace, numpy's bias sum), the allowed actions' penalty added."""
    index, unsure = [], []
    for i, grid in enumerate(grids):
        logits = policy.approximate_logits(grid).astype(np.float64)
        if masks is not None:
            logits = logits + np.where(masks[i if len(masks) > 1 else 0], 0.0, -np.inf)
        rows_index, rows_unsure = fast_tanh.decide_rows(logits, len(grid), tol)
        index.append(rows_index[0])
        unsure.append(rows_unsure[0])
    return np.stack(index), np.array(unsure)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**16), hidden=st.sampled_from([(16,), (64, 64), (128, 128)]),
       streams=st.integers(1, 6), masked=st.booleans(), tol=st.sampled_from([0.0, 1e-3, 0.05]))
def test_compiled_forward_is_the_approximate_forward_per_grid(seed, hidden, streams, masked,
                                                              tol) -> None:
    """forward_decide computes each stream's logits bit for bit as approximate_logits does
    on that stream's grid alone (the same sgemm calls, the same float32 sums, the same
    tanh): the same arg-max and the same unsure marks at any tolerance."""
    rng = np.random.default_rng(seed)
    base = ExportedPolicy.random(SPEC, hidden=hidden, seed=seed)
    policy = ExportedPolicy(weights=base.weights, actions=base.actions, feature_spec=SPEC,
                            biases=[rng.normal(0.0, 0.5, b.shape).astype(np.float32)
                                    for b in base.biases])
    grids = rng.uniform(-1.5, 1.5, size=(streams, ROWS, SPEC.size)).astype(np.float32)
    masks = (np.stack([rng.random(len(policy.actions)) < 0.7 for _ in range(streams)])
             if masked else None)
    weights, biases = policy._layers
    index, unsure, count = fast_tanh.forward_decide(
        grids.reshape(streams * ROWS, -1), weights, biases,
        policy._all_allowed if masks is None else masks, ROWS, tol, never_sure(policy))
    want_index, want_unsure = approximate_decisions(policy, grids, masks, tol)
    np.testing.assert_array_equal(unsure, want_unsure)
    assert count == int(want_unsure.sum())
    np.testing.assert_array_equal(index[~unsure], want_index[~unsure])


@pytest.mark.parametrize("hidden", [(16,), (64, 64), (128, 128)])
def test_products_tolerance_covers_the_measured_difference(hidden) -> None:
    """Half the products' tolerance bounds |compiled - exact| of every logit (the compiled
    logits: approximate_logits per grid, the kernel's bit for bit as tested above), on
    drawn grids and on the tanh's steep region; and it is tolerance()'s and more."""
    rng = np.random.default_rng(len(hidden))
    base = ExportedPolicy.random(SPEC, hidden=hidden, seed=9)
    policy = ExportedPolicy(weights=[w * np.float32(3.0) for w in base.weights],
                            actions=base.actions, feature_spec=SPEC,
                            biases=[rng.normal(0.0, 0.5, b.shape).astype(np.float32)
                                    for b in base.biases])
    assert policy.products_tolerance > policy.tanh_tolerance > 0
    worst = 0.0
    for scale in (0.05, 0.3, 1.5):
        for _ in range(30):
            grid = (rng.standard_normal((ROWS, SPEC.size)) * scale).astype(np.float32)
            diff = policy.approximate_logits(grid).astype(np.float64) - policy.logits(grid)
            worst = max(worst, float(np.abs(diff).max()))
    assert 0 < worst <= policy.products_tolerance / 2


def test_products_tolerance_by_hand() -> None:
    """One hidden layer: the tanh's error and the last layer's rounding, through it."""
    w0 = np.float32([[1.0, -2.0], [0.5, 0.25]])
    w1 = np.float32([[3.0, -1.0], [-0.5, 2.0]])
    b1 = np.float32([0.25, -4.0])
    u = 2.0 ** -24
    gamma3 = 3 * u / (1 - 3 * u)
    column = np.abs(w1.astype(np.float64)).sum(axis=0)  # 3.5, 3.0
    change = (fast_tanh.TANH_ERROR * column + 2 * gamma3 * (column + np.abs(b1))
              + 2 * 3 * 2.0 ** -149)
    got = fast_tanh.products_tolerance([w0, w1], [np.zeros(2, np.float32), b1])
    assert got == pytest.approx(2 * change.max() * (1 + 1e-6), rel=1e-12)


def test_compiled_forward_sends_strided_observations_to_the_exact_forward() -> None:
    policy = ExportedPolicy.random(seed=6)
    wide = np.random.default_rng(6).uniform(-1, 1, size=(2 * ROWS, 2 * SPEC.size)).astype(
        np.float32)
    x = wide[:, ::2]  # float32, two dimensions, not C-contiguous
    _, unsure, count = policy.compiled_decisions(x, ROWS, None)
    assert count == 2 and unsure.all()
    grids = x.reshape(2, ROWS, -1)
    np.testing.assert_array_equal(evaluate(policy, grids, [None] * 2, None, None, NO_GUARD)[0],
                                  exact_per_stream(policy, np.ascontiguousarray(grids),
                                                   [None] * 2))


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**16), hidden=st.sampled_from([(16,), (64, 64), (128, 128)]),
       masked=st.booleans())
def test_compiled_logits_are_the_approximate_logits_to_the_bit(seed, hidden, masked) -> None:
    """A razor's edge: at a tolerance equal to the grid's smallest gap between its best
    two allowed approximate logits the stream is unsure, one float64 step below it sure;
    logits other than approximate_logits' in any bit would move that gap (the decisions
    test above sees a difference only where it crosses a tolerance)."""
    rng = np.random.default_rng(seed)
    base = ExportedPolicy.random(SPEC, hidden=hidden, seed=seed)
    policy = ExportedPolicy(weights=base.weights, actions=base.actions, feature_spec=SPEC,
                            biases=[rng.normal(0.0, 0.5, b.shape).astype(np.float32)
                                    for b in base.biases])
    grid = rng.uniform(-1.5, 1.5, size=(ROWS, SPEC.size)).astype(np.float32)
    masks = policy._all_allowed
    if masked:
        masks = np.ones_like(masks)
        masks[0, rng.choice(masks.shape[1], size=2, replace=False)] = False
    logits = policy.approximate_logits(grid).astype(np.float64)
    best_two = np.sort(np.where(masks, logits, -np.inf), axis=1)[:, -2:]
    gap = float((best_two[:, 1] - best_two[:, 0]).min())
    weights, biases = policy._layers
    for tol, unsure in ((gap, True), (float(np.nextafter(gap, 0.0)), False)):
        got = fast_tanh.forward_decide(grid, weights, biases, masks, ROWS, tol,
                                       never_sure(policy))
        assert bool(got[1][0]) is unsure, (tol, gap)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**16), scale=st.sampled_from([0.3, 1.0, 2.0, 4.0]),
       hidden=st.sampled_from([16, 64, 128]), streams=st.integers(1, 6),
       gap=st.sampled_from([None, 0.0, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2]),
       spread=st.sampled_from([0.0, 1e-6, 1e-5]), masked=st.booleans())
def test_the_second_look_alone_keeps_the_exact_decisions(seed, scale, hidden, streams, gap,
                                                         spread, masked) -> None:
    """With an infinite tolerance every row gets forward_refinement's per-row bound alone:
    the decisions stay the exact forward's (near ties drawn as in the parity test)."""
    rng = np.random.default_rng(seed)
    if gap is None:
        base = ExportedPolicy.random(SPEC, hidden=(hidden, hidden), seed=seed)
        policy = ExportedPolicy(weights=[w * np.float32(scale) for w in base.weights],
                                biases=base.biases, actions=base.actions, feature_spec=SPEC)
    else:
        policy = near_tie_policy(seed, scale, hidden, gap, spread)
    policy.__dict__["products_tolerance"] = np.inf
    grids = rng.uniform(-1.5, 1.5, size=(streams, ROWS, SPEC.size)).astype(np.float32)
    allowed = [None if not masked or rng.random() < 0.3
               else rng.random(len(policy.actions)) < 0.6 for _ in range(streams)]
    index, _, _ = evaluate(policy, grids, allowed, None, None, NO_GUARD)
    np.testing.assert_array_equal(index, exact_per_stream(policy, grids, allowed))


def test_the_second_look_settles_rows_the_tolerance_leaves() -> None:
    """On a policy whose hidden units saturate (weights x3) the per-row bound settles
    most streams the tolerance alone sends to the exact forward, and still decides them
    as it does (so the test above compares something)."""
    base = ExportedPolicy.random(SPEC, hidden=(128, 128), seed=2)
    policy = ExportedPolicy(weights=[w * np.float32(3.0) for w in base.weights],
                            biases=base.biases, actions=base.actions, feature_spec=SPEC)
    grids = np.random.default_rng(2).uniform(-1.5, 1.5, size=(200, ROWS, SPEC.size)).astype(
        np.float32)
    x = grids.reshape(-1, SPEC.size)
    weights, biases = policy._layers
    _, alone, _ = fast_tanh.forward_decide(x, weights, biases, policy._all_allowed, ROWS,
                                           policy.products_tolerance, never_sure(policy))
    index, second, _ = fast_tanh.forward_decide(x, weights, biases, policy._all_allowed,
                                                ROWS, policy.products_tolerance,
                                                policy._refinement)
    assert not (second & ~alone).any()  # never less sure
    assert alone.sum() >= 20 and second.sum() <= alone.sum() // 2, (alone.sum(), second.sum())
    want = policy.logits(x).argmax(axis=1).reshape(len(grids), ROWS)
    np.testing.assert_array_equal(index[~second], want[~second])
