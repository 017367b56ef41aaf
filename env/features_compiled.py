"""The feature module's estimators compiled with numba: the same observations, cheaper.

:class:`CompiledFeatureBuilder` is :class:`env.features.FeatureBuilder` with its state in
one float64 array and its two hot paths compiled: folding a record (:func:`_fold`) and
the observation grids of many streams (:func:`_grids`). At the controller's sizes
(7 depths, 20 grid rows) the numpy implementation's cost is ~80 numpy calls of ~1 us
overhead each per decision; compiled, a decision's features cost a few microseconds.

The arithmetic is the numpy implementation's, operation for operation in the same order,
except where numpy does not say its order: the 7 x 7 ridge solve (LAPACK there, Gaussian
elimination with partial pivoting here), the regression's matrix-vector products (BLAS
there), and numpy's own vectorised ``log``/``log1p`` (libm here). So the two agree to
float rounding (``tests/test_features_compiled.py``: hypothesis streams, both backends),
not bit for bit; within one backend batching stays invisible, bit for bit. Training and
serving on one installation use the same backend (``SPECCTL_FEATURES`` chooses; the
default is compiled when numba imports).

The off probe (:mod:`env.probe`, ``ProbeSpec.off_share`` > 0) is folded here too
(:class:`CompiledProbeTracker`, :func:`fold_off`: ``ProbeTracker._fold_off`` operation for
operation, the C library's ``pow`` and ``log`` as Python's, so the same state bit for bit,
``tests/test_probe_compiled.py``), in the same compiled call as the record's features
(:func:`_fold_probed`): in Python it had cost ~1.1 us per decode record on top of a
~2.5-us fold. Its step that needs the features' latency prediction (``off_due``) and the
acceptance probe stay in Python, shared with the numpy backend.

Compiled functions are cached on disk (numba's ``cache=True``): the first process that
uses them compiles for a few seconds, later ones load in well under one. numba checks
only the cached function's own file for changes, so every kernel another one calls lives
in this file (a kernel in another module, changed, would leave a stale caller cached).
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numba import njit

from env.features import (
    LOCAL_BUCKETS,
    LOCAL_NEIGHBOUR,
    NEVER_MEASURED,
    FeatureBuilder,
    FeatureSpec,
    _Batch,
    _layout,
    effective_model,
    local_bucket,
)
from env.probe import (
    _BUCKETS,
    PROBE_OFF,
    PROBE_START,
    CostProbe,
    ProbeSpec,
    ProbeTracker,
)
from env.sim.cost_model import CostProfile

# -- the state vector -----------------------------------------------------------------
# Scalars first, then per-depth arrays whose offsets follow from max_depth (D):
# trials [D], successes [D], cost samples [D + 1], the regression's 8 x 8 moments,
# its solution theta [7], then the local cost correction's clock and its cells' counts,
# log-error sums and update times [(D + 1) * LOCAL_BUCKETS each] (see _local_at), then the
# off ceiling's cells the same way [LOCAL_BUCKETS each] (see _off_cells_at).
_WAITING, _KV_USE, _KV_TOKENS, _PREFILL_SHARE = 0, 1, 2, 3
_BATCH_SIZE, _BATCH_EMA, _BATCH_TREND, _HAS_BATCH = 4, 5, 6, 7
_STEPS_USED, _SINCE_SWITCH, _SINCE_ACCEPT = 8, 9, 10
_LATENCY_EMA, _HAS_LATENCY, _THROUGHPUT_EMA, _HAS_THROUGHPUT = 11, 12, 13, 14
_PRIOR_LOG_ERROR = 15
_EARLY_LOG_ERROR, _EARLY_STEPS = 16, 17  # FeatureSpec.latency_outlier_relative
_SCALARS = 18

# -- the parameter vector (per spec; see _params) ---------------------------------------
_P_DEPTH, _P_ALPHA, _P_DECAY, _P_FORGET, _P_RIDGE = 0, 1, 2, 3, 4
_P_STRENGTH, _P_PRIOR_FIRST, _P_PER_SAMPLE, _P_SPEC_FRACTION, _P_DRAFT_FRACTION = 5, 6, 7, 8, 9
_P_HEAD, _P_WIDTH, _P_LOG_THROUGHPUT_AT, _P_MODEL = 10, 11, 12, 13
_P_OUTLIER_RATIO, _P_OUTLIER_TRUST, _P_OUTLIER_WARMUP = 14, 15, 16
_P_LOCAL = 17  # latency_local_samples where the correction runs (a profile), else 0
_P_LOCAL_TOLERANCE, _P_LOCAL_CAP = 18, 19
_P_OUTLIER_RELATIVE = 20
_P_OFF_OUTLIER_RATIO = 21  # FeatureSpec.latency_off_outlier_ratio
_P_OFF_CEILING = 22  # FeatureSpec.latency_off_ceiling, as exp(): the factor (0: none)
_P_OFF_CEILING_BATCH = 23  # FeatureSpec.latency_off_ceiling_batch
#: FeatureSpec.latency_off_ceiling_samples where off's cells are kept (a ceiling and a
#: profile), else 0; and the ceiling itself (a log ratio, as the spec gives it)
_P_OFF_CEILING_SAMPLES, _P_OFF_CEILING_LOG = 24, 25
_P_LAYOUT = 26  # then the layout's logs, mul, div (width each), then (latency_model 2)
# the no-profile prior's precision (7 x 7) and right-hand side (7): see _prior_at


def _offsets(depth: int) -> tuple[int, int, int, int, int, int]:
    """(trials, successes, samples, moments, theta, size) offsets in the state vector."""
    trials = _SCALARS
    successes = trials + depth
    samples = successes + depth
    moments = samples + depth + 1
    theta = moments + 64
    # then the local cost correction: its clock and 3 values per cell (see _cells), then
    # the off ceiling's 3 values per bucket (see _off_cells_at)
    end = theta + 8 + 3 * (depth + 1) * LOCAL_BUCKETS + 3 * LOCAL_BUCKETS
    return trials, successes, samples, moments, theta, end


def _cells(depth: int) -> int:
    """The local cost correction's cells (depth and batch bucket)."""
    return (depth + 1) * LOCAL_BUCKETS


_offsets_jit = njit(cache=True)(_offsets)
_cells_jit = njit(cache=True)(_cells)


@njit(cache=True)
def _local_at(depth):
    """Where the local cost correction's clock sits in the state vector (its cells'
    counts, sums and times follow)."""
    return _offsets_jit(depth)[4] + 7


@njit(cache=True)
def _off_cells_at(depth):
    """Where the off ceiling's cells' counts sit in the state vector (their log-error sums
    and update times follow, LOCAL_BUCKETS each; on the local correction's clock)."""
    return _local_at(depth) + 1 + 3 * _cells_jit(depth)


_local_bucket_jit = njit(cache=True)(local_bucket)


@functools.lru_cache(maxsize=16)
def _params(spec: FeatureSpec, has_profile: bool = False) -> np.ndarray:
    """The spec's estimator settings and the vector layout, as one float64 array (the latency
    model the one a builder with or without a profile runs: features.effective_model)."""
    layout = _layout(spec)
    head = np.array([
        spec.max_depth, spec.ema_alpha, spec.accept_decay, spec.latency_forgetting,
        spec.latency_ridge, spec.accept_prior_strength, spec.accept_prior_first,
        1.0 / spec.cost_confidence_samples, spec.speculation_prior_fraction,
        spec.draft_step_prior_fraction, layout.head, layout.width, 0.0,
        effective_model(spec.latency_model, has_profile), spec.latency_outlier_ratio,
        spec.latency_outlier_trust, spec.latency_outlier_warmup,
        spec.latency_local_samples if has_profile else 0.0, spec.latency_local_tolerance,
        float(spec.latency_local_cap), float(spec.latency_outlier_relative),
        spec.latency_off_outlier_ratio,
        math.exp(spec.latency_off_ceiling) if spec.latency_off_ceiling > 0.0 else 0.0,
        spec.latency_off_ceiling_batch,
        (spec.latency_off_ceiling_samples
         if has_profile and spec.latency_off_ceiling > 0.0 else 0.0),
        spec.latency_off_ceiling,
    ])
    return np.concatenate([head, layout.logs.astype(float), layout.mul, layout.div,
                           layout.prior_matrix.ravel(), layout.prior_rhs])


@njit(cache=True)
def _prior_at(params):
    """Where the no-profile prior's precision (then its right-hand side) starts in
    ``params`` (latency_model 2)."""
    return _P_LAYOUT + 3 * int(params[_P_WIDTH])


# -- the off probe's state vector (CompiledProbeTracker.off) -------------------------
# Scalars, then per batch bucket the weights, stamps and confirmations.
_OFF_STEPS, _OFF_BUDGET, _OFF_COST, _OFF_REMAINING, _OFF_BUCKET, _OFF_PREDICTED = 0, 1, 2, 3, 4, 5
_OFF_WEIGHTS = 6
_OFF_STAMPS = _OFF_WEIGHTS + _BUCKETS
_OFF_CONFIRMED = _OFF_STAMPS + _BUCKETS
_OFF_SIZE = _OFF_CONFIRMED + _BUCKETS
# The settings vector (CompiledProbeTracker.settings: ProbeSpec's off fields).
_OFF_SHARE, _OFF_CONFIRM, _OFF_TRUST, _OFF_SAMPLES, _OFF_UNPROFILED = 0, 1, 2, 3, 4


# -- kernels --------------------------------------------------------------------------

_LinAlgError = np.linalg.LinAlgError


@njit(cache=True)
def _maximum(a, b):
    """``np.maximum`` of two floats: NaN wins (a broken estimator must show)."""
    return a if a >= b or a != a else b


@njit(cache=True)
def _minimum(a, b):
    """``np.minimum`` of two floats: NaN wins."""
    return a if a <= b or a != a else b


@njit(cache=True)
def _solve(state, params, has_prior):
    """theta = (X'X + ridge I)^-1 (X'y + ridge * prior), as the numpy path's
    ``np.linalg.solve`` (Gaussian elimination, partial pivoting)."""
    depth = int(params[_P_DEPTH])
    _, _, _, mom, theta, _ = _offsets_jit(depth)
    ridge = params[_P_RIDGE]
    a = np.empty((7, 8))
    tied = params[_P_MODEL] == 2.0 and not has_prior
    for i in range(7):
        for j in range(7):
            a[i, j] = state[mom + 8 * i + j]
        if not tied:
            a[i, i] = a[i, i] + ridge
        a[i, 7] = state[mom + 8 * i + 7]
    if tied:  # latency_model 2: speculation's terms tied to off's (features._prior_ties)
        at = _prior_at(params)
        level = state[_LATENCY_EMA] if state[_HAS_LATENCY] else 10.0
        for i in range(7):
            for j in range(7):
                a[i, j] = a[i, j] + params[at + 7 * i + j]
            a[i, 7] = a[i, 7] + level * params[at + 49 + i]
    elif not has_prior:  # the observed level at depth 0, fixed fractions of it speculating
        level = state[_LATENCY_EMA] if state[_HAS_LATENCY] else 10.0
        a[0, 7] = a[0, 7] + (level * 1.0) * ridge
        a[2, 7] = a[2, 7] + (level * params[_P_SPEC_FRACTION]) * ridge
        a[4, 7] = a[4, 7] + (level * params[_P_DRAFT_FRACTION]) * ridge
    for k in range(7):
        pivot = k
        for i in range(k + 1, 7):
            if abs(a[i, k]) > abs(a[pivot, k]):
                pivot = i
        if a[pivot, k] == 0.0:
            raise _LinAlgError("Singular matrix")
        if pivot != k:
            for j in range(8):
                a[k, j], a[pivot, j] = a[pivot, j], a[k, j]
        for i in range(k + 1, 7):
            factor = a[i, k] / a[k, k]
            for j in range(k, 8):
                a[i, j] = a[i, j] - factor * a[k, j]
    for i in range(6, -1, -1):
        total = a[i, 7]
        for j in range(i + 1, 7):
            total = total - a[i, j] * state[theta + j]
        state[theta + i] = total / a[i, i]


# -- the cost profile's step latency (CostProfile.step_latency_s, compiled) --------------
# Its coefficients as one float64 vector (_profile_vector), in this order.
(_C_FIXED, _C_REQUEST, _C_TOKEN, _C_KV, _C_LOG_MOE, _C_MOE_SHARE, _C_MOE, _C_MOE_ACTIVE,
 _C_VERIFY, _C_VERIFY_TOKEN, _C_DRAFT, _C_DRAFT_TOKEN, _C_EXTEND, _C_EXTEND_TOKEN, _C_CG_MAX,
 _C_EAGER, _C_EAGER_TOKEN, _C_STEPS0, _C_STEPS0_REQUEST, _C_STEPS0_KV) = range(20)
#: No profile vector: the caller computes the prior in Python (see _profile_vector).
_NO_PROFILE = np.zeros(0)


@functools.lru_cache(maxsize=16)
def _profile_vector(cost_prior: CostProfile) -> np.ndarray:
    """A :class:`~env.sim.cost_model.CostProfile`'s terms that a decode step's latency
    reads, in :func:`_profile_ms`'s order (read only)."""
    vector = np.array([
        cost_prior.c_fixed, cost_prior.c_request, cost_prior.c_token, cost_prior.c_kv,
        cost_prior._log_moe, cost_prior.moe_draft_token_share, cost_prior.c_moe,
        cost_prior.moe_active_fraction, cost_prior.c_verify, cost_prior.c_verify_token,
        cost_prior.c_draft, cost_prior.c_draft_token, cost_prior.c_extend,
        cost_prior.c_extend_token, cost_prior._cg_max, cost_prior.c_eager,
        cost_prior.c_eager_token, cost_prior.c_steps0, cost_prior.c_steps0_request,
        cost_prior.c_steps0_kv], dtype=np.float64)
    vector.flags.writeable = False
    return vector


@njit(cache=True)
def _profile_ms(profile, batch_size, depth, kv_tokens):
    """``1e3 * CostProfile.step_latency_s(batch_size, depth, kv_tokens, 0,
    draft_extend=depth > 0, speculative_path=depth > 0)`` (the prior a decode record is
    folded with: ``FeatureBuilder.update``), operation for operation in the same order
    (no fast-math: the same float64 roundings, bit for bit, tests/test_features_compiled.py)
    from :func:`_profile_vector`. In Python the call cost ~1 us of a record's ~5."""
    tokens = batch_size * (depth + 1)  # + prefill_tokens (0)
    latency = (profile[_C_FIXED] + profile[_C_REQUEST] * batch_size
               + profile[_C_TOKEN] * tokens + profile[_C_KV] * kv_tokens)
    log_moe = profile[_C_LOG_MOE]
    if log_moe != 0.0:
        share = profile[_C_MOE_SHARE]
        # (tokens as a float is exact: the same product as Python's int * float)
        moe_tokens = float(tokens) if share == 1.0 else batch_size * (1.0 + share * depth)
        latency += profile[_C_MOE] * -math.expm1(moe_tokens * log_moe)
    elif profile[_C_MOE_ACTIVE] == 1.0 and tokens > 0:
        latency += profile[_C_MOE]
    if depth > 0:
        latency += profile[_C_VERIFY] + profile[_C_VERIFY_TOKEN] * batch_size
        if depth > 1:
            latency += (depth - 1) * (profile[_C_DRAFT] + profile[_C_DRAFT_TOKEN] * batch_size)
        latency += profile[_C_EXTEND] + profile[_C_EXTEND_TOKEN] * tokens
    # (draft_extend at depth 0 is False: no extend term there)
    if batch_size > profile[_C_CG_MAX]:
        latency += profile[_C_EAGER] + profile[_C_EAGER_TOKEN] * batch_size
    if batch_size and depth > 0:  # speculative_path is depth > 0
        latency += (profile[_C_STEPS0] + profile[_C_STEPS0_REQUEST] * batch_size
                    + profile[_C_STEPS0_KV] * kv_tokens)
    return 1e3 * latency


@njit(cache=True)
def _fold(state, params, has_prior, is_decode, batch_size, waiting, kv_tokens, kv_capacity,
          steps_used, accepted, latency_s, prior_ms, profile, warmup):
    """``FeatureBuilder.update`` on the state vector (``prior_ms``: the cost profile's
    latency of this step, ms, when ``has_prior``; computed here instead from ``profile``,
    :func:`_profile_vector`, where that is not empty; ``warmup``: the record is flagged a
    re-entry warm-up, ``StepRecord.warmup is True``)."""
    depth = int(params[_P_DEPTH])
    tri, suc, smp, mom, _, _ = _offsets_jit(depth)
    alpha = params[_P_ALPHA]
    state[_WAITING] = waiting
    # StepRecord.kv_use (exact integers: the same quotient as Python's int / int)
    state[_KV_USE] = 0.0 if kv_capacity <= 0 else min(1.0, kv_tokens / kv_capacity)
    state[_KV_TOKENS] = kv_tokens
    is_prefill = 0.0 if is_decode else 1.0
    state[_PREFILL_SHARE] += alpha * (is_prefill - state[_PREFILL_SHARE])
    if not is_decode:
        return

    batch = max(batch_size, 1)
    if not state[_HAS_BATCH]:
        state[_HAS_BATCH] = 1.0
        state[_BATCH_EMA] = float(batch)
    ema = state[_BATCH_EMA]
    trend = (batch - ema) / max(ema, 1.0)
    state[_BATCH_TREND] += alpha * (trend - state[_BATCH_TREND])
    state[_BATCH_EMA] = ema + alpha * (batch - ema)
    state[_BATCH_SIZE] = batch

    steps = min(max(steps_used, 0), depth)
    previous = int(state[_STEPS_USED])
    reentry = steps > 0 and previous == 0
    if steps != previous:
        state[_SINCE_SWITCH] = 0.0
    else:
        state[_SINCE_SWITCH] += 1.0
    state[_STEPS_USED] = steps

    n = accepted.shape[0]
    total_accepted = 0
    most = 0
    for i in range(n):
        a = int(accepted[i])
        if a < 0:
            raise ValueError("accepted_drafts has a negative entry")
        total_accepted += a
        most = max(most, a)
    counts = np.zeros(most + 1, dtype=np.int64)
    for i in range(n):
        counts[int(accepted[i])] += 1

    if latency_s > 0.0:
        latency_ms = latency_s * 1e3
        residual_ms = latency_ms
        error = 0.0
        if has_prior:
            if profile.shape[0]:
                prior_ms = _profile_ms(profile, batch, steps, kv_tokens)
            ratio = params[_P_OUTLIER_RATIO]
            relative = params[_P_OUTLIER_RELATIVE] > 0.0
            if (ratio > 0.0 and latency_ms > ratio * prior_ms
                    and abs(state[_PRIOR_LOG_ERROR]) < params[_P_OUTLIER_TRUST]):
                # Summed only for a candidate outlier, as FeatureBuilder.update's sum()
                measured = 0.0
                for d in range(depth + 1):
                    measured += state[smp + d]
                if measured >= params[_P_OUTLIER_WARMUP]:
                    latency_ms = ratio * prior_ms  # FeatureSpec.latency_outlier_ratio
                    residual_ms = latency_ms
                elif (relative and state[_EARLY_STEPS] > 0.0
                      and latency_ms > ratio * prior_ms * math.exp(
                          state[_EARLY_LOG_ERROR] / state[_EARLY_STEPS])):
                    latency_ms = ratio * prior_ms  # FeatureSpec.latency_outlier_relative
                    residual_ms = latency_ms
            off_ratio = params[_P_OFF_OUTLIER_RATIO]
            if (off_ratio > 0.0 and steps == 0 and latency_ms > off_ratio * prior_ms
                    and abs(state[_PRIOR_LOG_ERROR]) < params[_P_OUTLIER_TRUST]):
                measured = 0.0  # FeatureSpec.latency_off_outlier_ratio
                for d in range(depth + 1):
                    measured += state[smp + d]
                if measured >= params[_P_OUTLIER_WARMUP]:
                    latency_ms = off_ratio * prior_ms
                    residual_ms = latency_ms
            residual_ms -= prior_ms
            error = math.log(latency_ms / max(prior_ms, 1e-6))
            state[_PRIOR_LOG_ERROR] += alpha * (error - state[_PRIOR_LOG_ERROR])
            if relative:
                state[_EARLY_LOG_ERROR] += error
                state[_EARLY_STEPS] += 1.0
        forget = params[_P_FORGET]
        for d in range(depth + 1):
            state[smp + d] *= forget
        state[smp + steps] += 1.0
        off_cells = params[_P_OFF_CEILING_SAMPLES] > 0.0
        if params[_P_LOCAL] > 0.0 or off_cells:  # the cells' clock
            state[_local_at(depth)] += 1.0
        if params[_P_LOCAL] > 0.0:  # FeatureBuilder.update's local cost correction
            lo = _local_at(depth)
            cells = _cells_jit(depth)
            clock = state[lo]
            cell = lo + 1 + steps * LOCAL_BUCKETS + _local_bucket_jit(batch)
            decay = forget ** (clock - state[cell + 2 * cells])
            state[cell] = state[cell] * decay + 1.0
            state[cell + cells] = state[cell + cells] * decay + error
            state[cell + 2 * cells] = clock
        if off_cells and steps == 0 and not warmup:  # FeatureSpec.latency_off_ceiling_samples
            clock = state[_local_at(depth)]
            cell = _off_cells_at(depth) + _local_bucket_jit(batch)
            decay = forget ** (clock - state[cell + 2 * LOCAL_BUCKETS])
            state[cell] = state[cell] * decay + 1.0
            state[cell + LOCAL_BUCKETS] = state[cell + LOCAL_BUCKETS] * decay + error
            state[cell + 2 * LOCAL_BUCKETS] = clock
        z = np.empty(8)
        b = batch / 64.0
        s = 1.0 if steps > 0 else 0.0
        m = float(max(steps - 1, 0))
        if params[_P_MODEL] == 1.0:
            z[0], z[1], z[2], z[3] = 1.0, b, s, s * b
            z[4], z[5], z[6], z[7] = m, m * b, kv_tokens / 1e5, residual_ms
        else:  # features._regressor_row's model 2: off apart, verify tokens
            o, kv = 1.0 - s, kv_tokens / 1e5
            z[0], z[1], z[2], z[3] = o, o * b, s, s * ((steps + 1) * b)
            z[4], z[5], z[6], z[7] = m, o * kv, s * kv, residual_ms
        for i in range(8):
            for j in range(8):
                k = mom + 8 * i + j
                state[k] = state[k] * forget + z[i] * z[j]
        if not state[_HAS_LATENCY]:
            state[_HAS_LATENCY] = 1.0
            state[_LATENCY_EMA] = latency_ms
        else:
            state[_LATENCY_EMA] += alpha * (latency_ms - state[_LATENCY_EMA])
        rate = (batch_size + total_accepted) / latency_s
        if not state[_HAS_THROUGHPUT]:
            state[_HAS_THROUGHPUT] = 1.0
            state[_THROUGHPUT_EMA] = rate
        else:
            state[_THROUGHPUT_EMA] += alpha * (rate - state[_THROUGHPUT_EMA])
        _solve(state, params, has_prior)

    if steps > 0 and n > 0 and not reentry:
        # As FeatureBuilder.update: a request accepting a >= steps drafts succeeded at
        # every position 1..steps.
        decay = params[_P_DECAY]
        reached = n
        for k in range(depth):
            state[tri + k] *= decay
            state[suc + k] *= decay
            if k < steps:
                state[tri + k] += reached
                reached -= counts[k] if k <= most else 0
                state[suc + k] += reached
        state[_SINCE_ACCEPT] = 0.0
    else:
        state[_SINCE_ACCEPT] += 1.0


# The off probe's kernels read its bucket count from the state vector's length, not from
# env.probe's constant: numba freezes a global at compile time, and a cached kernel is not
# recompiled when another module changes (see the module's docstring), so a stale one must
# still index within the vector the tracker allocates.


@njit(cache=True)
def _off_bucket(batch, buckets):
    """``env.probe.off_bucket``: floor(log2(max(batch, 1))), the last bucket open."""
    bucket = 0
    rest = max(batch, 1)
    while rest > 1:
        rest >>= 1
        bucket += 1
    return min(bucket, buckets - 1)


@njit(cache=True)
def _off_coverage(off, bucket, forget, buckets):
    """``ProbeTracker.off_coverage`` at ``bucket``."""
    now = off[_OFF_STEPS]
    stamps = _OFF_WEIGHTS + buckets
    total = 0.0
    for j in range(3):
        k = bucket - 1 + j
        share = 1.0 if j == 1 else 0.5
        if 0 <= k < buckets and off[_OFF_WEIGHTS + k] != 0.0:
            total += share * off[_OFF_WEIGHTS + k] * forget ** (now - off[stamps + k])
    return total


@njit(cache=True)
def fold_off(off, settings, forget, has_prior, profile_log_error, steps_used, latency_s,
             batch):
    """``ProbeTracker._fold_off`` on the state vector, up to the step that needs the
    features' prediction: returns True when that step is due (the caller then runs
    :meth:`ProbeTracker.off_due`)."""
    buckets = (off.shape[0] - _OFF_WEIGHTS) // 3
    stamps, confirmed = _OFF_WEIGHTS + buckets, _OFF_WEIGHTS + 2 * buckets
    off[_OFF_STEPS] += 1.0
    if latency_s <= 0.0:
        return False
    bucket = _off_bucket(batch, buckets)
    if not steps_used:  # off measured at this batch
        at = _OFF_WEIGHTS + bucket
        off[at] = 1.0 + off[at] * forget ** (off[_OFF_STEPS] - off[stamps + bucket])
        off[stamps + bucket] = off[_OFF_STEPS]
        if off[_OFF_BUCKET] == bucket:
            off[_OFF_BUCKET] = -1.0
            if abs(math.log(latency_s / off[_OFF_PREDICTED])) <= settings[_OFF_CONFIRM]:
                off[confirmed + bucket] = 1.0
        off[_OFF_BUDGET] = 0.0
        if off[_OFF_REMAINING]:
            off[_OFF_REMAINING] -= 1.0
        return False
    if off[_OFF_REMAINING]:
        off[_OFF_REMAINING] -= 1.0
        return False
    if (off[confirmed + bucket]
            or _off_coverage(off, bucket, forget, buckets) >= settings[_OFF_SAMPLES]
            or (settings[_OFF_TRUST] and has_prior
                and abs(profile_log_error) <= settings[_OFF_TRUST])):
        off[_OFF_BUDGET] = 0.0  # off's cost here is known or trusted: nothing to do
        return False
    share = settings[_OFF_SHARE] if has_prior else (settings[_OFF_SHARE]
                                                    * settings[_OFF_UNPROFILED])
    off[_OFF_BUDGET] += share * latency_s  # ProbeSpec.off_share_of
    return not off[_OFF_BUDGET] < off[_OFF_COST]


@njit(cache=True)
def _fold_probed(state, params, has_prior, batch_size, waiting, kv_tokens, kv_capacity,
                 steps_used, accepted, latency_s, prior_ms, profile, warmup, off, settings):
    """:func:`_fold` of a decode record, then the off probe's fold of it
    (:func:`fold_off`, in the same call): whether the probe's step
    that needs the features' prediction is due (``ProbeTracker.off_due``)."""
    _fold(state, params, has_prior, True, batch_size, waiting, kv_tokens, kv_capacity,
          steps_used, accepted, latency_s, prior_ms, profile, warmup)
    return fold_off(off, settings, params[_P_FORGET], has_prior, state[_PRIOR_LOG_ERROR],
                    steps_used, latency_s, max(batch_size, 1))


@njit(cache=True)
def _cell_tables(state, first, stride, clock, forget, samples, weight, ratio, counts, sums):
    """``env.features.local_tables`` of the cells whose counts sit at ``state[first + d *
    LOCAL_BUCKETS + j]`` (log-error sums ``stride`` later, update times ``2 * stride``
    later), for rows d < ``weight.shape[0]``, into ``weight`` and ``ratio`` (``counts`` and
    ``sums``: scratch, that shape)."""
    rows = weight.shape[0]
    for d in range(rows):
        for j in range(LOCAL_BUCKETS):
            cell = first + d * LOCAL_BUCKETS + j
            if state[cell] == 0.0:  # never measured (most cells): 0 either way, no pow
                counts[d, j] = sums[d, j] = 0.0
                continue
            decay = forget ** (clock - state[cell + 2 * stride])
            counts[d, j] = state[cell] * decay
            sums[d, j] = state[cell + stride] * decay
    for d in range(rows):
        for j in range(LOCAL_BUCKETS):
            near_count, near_sum = counts[d, j], sums[d, j]
            if j > 0:
                near_count += LOCAL_NEIGHBOUR * counts[d, j - 1]
                near_sum += LOCAL_NEIGHBOUR * sums[d, j - 1]
            if j < LOCAL_BUCKETS - 1:
                near_count += LOCAL_NEIGHBOUR * counts[d, j + 1]
                near_sum += LOCAL_NEIGHBOUR * sums[d, j + 1]
            ratio[d, j] = near_sum / near_count if near_count > 0.0 else 0.0
            weight[d, j] = -math.expm1(-near_count / samples)


@njit(cache=True)
def _local_tables(state, params, weight, ratio, counts, sums):
    """``env.features.local_tables`` of one stream's local cost correction, into
    ``weight`` and ``ratio`` (depth + 1, LOCAL_BUCKETS; ``counts`` and ``sums``: scratch,
    that shape)."""
    depth = int(params[_P_DEPTH])
    lo = _local_at(depth)
    _cell_tables(state, lo + 1, _cells_jit(depth), state[lo], params[_P_FORGET],
                 params[_P_LOCAL], weight, ratio, counts, sums)


@njit(cache=True)
def _off_ceiling_lift(state, params, lift, weight, ratio, counts, sums):
    """``env.features._off_ceiling_lift`` of one stream's state, per batch bucket, into
    ``lift`` (LOCAL_BUCKETS; the others: scratch, 1 x LOCAL_BUCKETS)."""
    depth = int(params[_P_DEPTH])
    _cell_tables(state, _off_cells_at(depth), LOCAL_BUCKETS, state[_local_at(depth)],
                 params[_P_FORGET], params[_P_OFF_CEILING_SAMPLES], weight, ratio, counts,
                 sums)
    for j in range(LOCAL_BUCKETS):
        beyond = _maximum(ratio[0, j] - params[_P_OFF_CEILING_LOG], 0.0)
        lift[j] = math.exp(weight[0, j] * beyond)


@njit(cache=True)
def _grids(states, params, has_prior, design, at0, slope, column0, buckets, out, latency,
           rates, expected):
    """``env.features._batch`` for stacked states: fills ``out`` (streams, rows, size),
    ``latency`` (depth + 1, streams, rows) (s), ``rates`` and ``expected`` (``buckets``:
    each row's batch bucket, for the local cost correction)."""
    depth = int(params[_P_DEPTH])
    tri, suc, smp, _, theta, _ = _offsets_jit(depth)
    head = int(params[_P_HEAD])
    width = int(params[_P_WIDTH])
    logs = params[_P_LAYOUT:_P_LAYOUT + width]
    mul = params[_P_LAYOUT + width:_P_LAYOUT + 2 * width]
    div = params[_P_LAYOUT + 2 * width:_P_LAYOUT + 3 * width]
    strength, per_sample = params[_P_STRENGTH], params[_P_PER_SAMPLE]
    split = params[_P_MODEL] == 2.0
    rows = column0.shape[0]
    entries = np.empty(width)
    log_tokens = np.empty(depth + 1)
    log_latency = np.empty(depth + 1)
    local = params[_P_LOCAL] > 0.0
    tolerance = params[_P_LOCAL_TOLERANCE]
    cap = params[_P_LOCAL_CAP] > 0.0
    ceiling = params[_P_OFF_CEILING]
    ceiling_batch = params[_P_OFF_CEILING_BATCH]
    off_cells = params[_P_OFF_CEILING_SAMPLES] > 0.0
    lift = np.ones(LOCAL_BUCKETS)
    off_tables = np.zeros((4, 1, LOCAL_BUCKETS))  # _off_ceiling_lift's scratch
    weight = np.zeros((depth + 1, LOCAL_BUCKETS))
    ratio = np.zeros((depth + 1, LOCAL_BUCKETS))
    local_ms = np.empty(depth + 1)
    local_counts = np.empty((depth + 1, LOCAL_BUCKETS))
    local_sums = np.empty((depth + 1, LOCAL_BUCKETS))
    for n in range(states.shape[0]):
        state = states[n]
        # _acceptance(): each position's prior is the estimate of the position before it
        prior = params[_P_PRIOR_FIRST]
        reach, total = 1.0, 0.0
        expected[n, 0] = 0.0
        for k in range(depth):
            prior = (state[suc + k] + strength * prior) / (state[tri + k] + strength)
            rates[n, k] = prior
            reach *= prior
            total += reach
            expected[n, k + 1] = total
        # The state row's batch-independent entries (FeatureBuilder._state_row order).
        entries[0] = state[_WAITING]
        entries[1] = state[_KV_USE]
        entries[2] = state[_BATCH_TREND]
        entries[3] = state[_PREFILL_SHARE]
        entries[4] = state[_STEPS_USED]
        entries[5] = state[_SINCE_SWITCH]
        entries[6] = state[_SINCE_ACCEPT]
        for k in range(depth):
            entries[7 + k] = rates[n, k]
            entries[7 + depth + k] = state[tri + k]
        at = 7 + 2 * depth
        entries[at] = state[_LATENCY_EMA] if state[_HAS_LATENCY] else 0.0
        entries[at + 1] = state[_THROUGHPUT_EMA] if state[_HAS_THROUGHPUT] else 0.0
        for d in range(depth + 1):
            entries[at + 2 + d] = -math.expm1(-state[smp + d] * per_sample)
        entries[at + 3 + depth] = 1.0 if has_prior else 0.0
        entries[at + 4 + depth] = state[_PRIOR_LOG_ERROR]
        for j in range(width):
            value = math.log1p(entries[j]) if logs[j] else entries[j]
            # saturated into the box here, once, not in every row (the same values)
            entries[j] = _maximum(_minimum(value * mul[j] / div[j], 1.0), -1.0)
        kv = state[_KV_TOKENS]
        base_ms = state[_LATENCY_EMA] if state[_HAS_LATENCY] else 10.0
        floor = _maximum(0.05 * base_ms, 1e-3)
        # FeatureSpec.latency_off_ceiling: off at most the factor x the profile, if trusted
        off_ceiling = (has_prior and ceiling > 0.0
                       and abs(state[_PRIOR_LOG_ERROR]) < params[_P_OUTLIER_TRUST])
        for d in range(depth + 1):
            log_tokens[d] = math.log1p(expected[n, d])
        if off_ceiling and off_cells:
            _off_ceiling_lift(state, params, lift, off_tables[0], off_tables[1],
                              off_tables[2], off_tables[3])
        if local:
            _local_tables(state, params, weight, ratio, local_counts, local_sums)
        for r in range(rows):
            # _latency_predictions(): the regression per depth, floored, non-decreasing
            running = -np.inf
            for d in range(depth + 1):
                i = d * rows + r  # (a row view per step would cost a third more)
                value = design[i, 0] * state[theta]
                for j in range(1, 6):
                    value += design[i, j] * state[theta + j]
                # model 2: off's KV term at depth 0 (features._latency_predictions)
                kv_at = 5 if split and d == 0 else 6
                value += state[theta + kv_at] * (kv / 1e5)
                profile_ms = 1.0
                if has_prior:
                    profile_ms = at0[d, 0, r] + slope[d, 0, r] * kv
                    value += profile_ms
                value = _maximum(value, floor)
                # (latency_off_ceiling_batch: design[r, 1] is max(b, 1) / 64 at depth 0,
                # exact in binary, as features._design builds it)
                if d == 0 and off_ceiling and design[r, 1] * 64.0 >= ceiling_batch:
                    value = _minimum(value, profile_ms * ceiling * lift[buckets[r]])
                if local:  # features._correct_locally, then its blended running maximum
                    j = buckets[r]
                    w = weight[d, j]
                    # (weight 0, an unmeasured cell: numpy's factors are exp(0) = 1 exactly)
                    if w != 0.0:
                        gap = math.log(profile_ms) + ratio[d, j] - math.log(value)
                        beyond = _maximum(abs(gap) - tolerance, 0.0)
                        value = value * math.exp(w * math.copysign(beyond, gap))
                    if d == 0:
                        running = value
                    elif w != 0.0:
                        up = _maximum(value, running)
                        running = up * math.exp(w * (math.log(value) - math.log(up)))
                    else:
                        running = _maximum(value, running)
                    local_ms[d] = running
                else:
                    earlier = running
                    running = _maximum(running, value)
                    latency[d, n, r] = running * 1e-3
                    # The running maximum held (the regression's deeper depths predict
                    # no more): the same product, so the same log, not another libm call
                    # (a flood's rows hold at half their depths; the log is a quarter of
                    # this kernel). NaN never compares equal: it takes the call.
                    if d > 0 and running == earlier:
                        log_latency[d] = log_latency[d - 1]
                    else:
                        log_latency[d] = math.log(latency[d, n, r])
            if local:  # features._latency_predictions' blended cap from deeper depths (if cap)
                j = buckets[r]
                for d in range(depth - 1 if cap else -1, -1, -1):
                    value = local_ms[d]
                    down = _minimum(value, local_ms[d + 1])
                    if weight[d, j] != 0.0:
                        down = down * math.exp(weight[d, j] * (math.log(value) - math.log(down)))
                    local_ms[d] = down
                for d in range(depth + 1):
                    latency[d, n, r] = local_ms[d] * 1e-3
                    log_latency[d] = math.log(latency[d, n, r])
            # Every value saturates into the box [-1, 1] (column0 and entries already
            # are; the goodput term is within it by construction).
            vector = out[n, r]
            vector[0] = column0[r]
            for j in range(head):
                vector[1 + j] = entries[j]
            at = 1 + head
            for d in range(1, depth + 1):
                slower = log_latency[d] - log_latency[0]
                gain = log_tokens[d] - log_tokens[0]
                vector[at + d - 1] = _maximum(_minimum(slower, 3.0) / 3.0, -1.0)
                vector[at + depth + d - 1] = _maximum(_minimum(gain - slower, 3.0), -3.0) / 3.0
            for j in range(head, width):
                vector[at + 2 * depth + j - head] = entries[j]


# -- the off probe's tracker ---------------------------------------------------------


class CompiledProbeTracker(ProbeTracker):
    """:class:`~env.probe.ProbeTracker` with the off probe's state (its budget and cost,
    due records, the latest probe's bucket and prediction, and per batch bucket the off
    measurements' weights and stamps and the confirmations) in :attr:`off`, folded by
    :func:`fold_off`. Its off attributes read (and :meth:`off_due` writes) that array."""

    __slots__ = ("off", "settings")

    def __init__(self, spec: ProbeSpec) -> None:
        #: The off fields of ``spec`` (see _OFF_SHARE...), as :func:`fold_off` reads them.
        self.settings = np.array([spec.off_share, spec.off_confirm, spec.off_trust,
                                  spec.off_samples, spec.off_unprofiled], dtype=np.float64)
        super().__init__(spec)

    def reset(self, unprofiled: bool = False) -> None:
        """Forget the budgets (a new stream; ``unprofiled``: it has no cost profile)."""
        self.reset_start(unprofiled)
        self.reset_acceptance(not unprofiled)
        self.cost_probe = CostProbe(self.spec) if self.spec.cost_depth else None
        self.off = np.zeros(_OFF_SIZE)
        self.off[_OFF_BUCKET] = -1.0

    def copy(self) -> CompiledProbeTracker:
        """An independent copy (the daemon evaluates a copy of a stream's features)."""
        new = object.__new__(CompiledProbeTracker)
        new.spec, new.settings = self.spec, self.settings  # never changed once built
        new.budget_s, new.cost_s, new.remaining = self.budget_s, self.cost_s, self.remaining
        new.off = self.off.copy()
        new.cost_probe = None if self.cost_probe is None else self.cost_probe.copy()
        new.start_state_of(self)
        return new

    def _fold_off(self, steps_used: int, latency_s: float, features, batch: int) -> None:
        if fold_off(self.off, self.settings, features.spec.latency_forgetting,
                    features.cost_prior is not None, features.profile_log_error,
                    steps_used, latency_s, batch):
            self.off_due(features, batch)

    # -- ProbeTracker's off attributes, on the state vector --------------------------

    @property
    def decode_steps(self) -> int:
        return int(self.off[_OFF_STEPS])

    @property
    def off_budget_s(self) -> float:
        return float(self.off[_OFF_BUDGET])

    @off_budget_s.setter
    def off_budget_s(self, value: float) -> None:
        self.off[_OFF_BUDGET] = value

    @property
    def off_cost_s(self) -> float:
        return float(self.off[_OFF_COST])

    @off_cost_s.setter
    def off_cost_s(self, value: float) -> None:
        self.off[_OFF_COST] = value

    @property
    def due(self) -> int:
        """:attr:`ProbeTracker.due`, the off count read from the vector here (the daemon
        asks every answered stream: one property call less)."""
        if self.start_force:
            return PROBE_START
        return PROBE_OFF if self.off[_OFF_REMAINING] else self._due_unless_off()

    @property
    def off_remaining(self) -> int:
        return int(self.off[_OFF_REMAINING])

    @off_remaining.setter
    def off_remaining(self, value: int) -> None:
        self.off[_OFF_REMAINING] = value

    @property
    def off_expected(self) -> tuple[int, float] | None:
        bucket = int(self.off[_OFF_BUCKET])
        return None if bucket < 0 else (bucket, float(self.off[_OFF_PREDICTED]))

    @off_expected.setter
    def off_expected(self, value: tuple[int, float] | None) -> None:
        bucket, predicted = (-1, 0.0) if value is None else value
        self.off[_OFF_BUCKET], self.off[_OFF_PREDICTED] = bucket, predicted

    @property
    def off_weights(self) -> list[float]:
        return self.off[_OFF_WEIGHTS:_OFF_WEIGHTS + _BUCKETS].tolist()

    @property
    def off_stamps(self) -> list[int]:
        return [int(v) for v in self.off[_OFF_STAMPS:_OFF_STAMPS + _BUCKETS]]

    @property
    def off_confirmed(self) -> list[bool]:
        return [bool(v) for v in self.off[_OFF_CONFIRMED:_OFF_CONFIRMED + _BUCKETS]]


# -- the builder ----------------------------------------------------------------------


#: _grid_inputs' caches by (spec, the cost prior's id): the prior kept alive with its
#: cache (its id is not reused while the entry holds it); emptied when it grows past
#: _SHARED_INPUTS (builders keep the cache they took: only new builders start afresh).
_inputs_caches: dict[tuple, tuple[object, dict]] = {}
_SHARED_INPUTS = 64


def _shared_inputs(spec: FeatureSpec, cost_prior) -> dict[tuple, tuple]:
    """The :meth:`CompiledFeatureBuilder._grid_inputs` cache of builders with this spec
    and this cost prior (the same object, or None): what it holds depends on them only."""
    key = (spec, id(cost_prior))
    entry = _inputs_caches.get(key)
    if entry is None:  # (the entry holds the prior: no other object has its id meanwhile)
        if len(_inputs_caches) >= _SHARED_INPUTS:
            _inputs_caches.clear()
        entry = _inputs_caches[key] = (cost_prior, {})
    return entry[1]


class CompiledFeatureBuilder(FeatureBuilder):
    """:class:`~env.features.FeatureBuilder` with its estimators compiled (numba).

    Construct it as ``FeatureBuilder(spec, cost_prior, backend="compiled")`` (the
    default when numba is installed). Its private attributes that the numpy builder
    keeps as Python values read the state vector here.
    """

    backend = "compiled"
    tracker_type = CompiledProbeTracker

    def reset(self) -> None:
        """Forget all telemetry."""
        self._params = _params(self.spec, self.cost_prior is not None)
        # The profile's prior computed in the compiled fold where the prior is a
        # CostProfile (another object's step_latency_s is called in Python, as before).
        self._profile = (_profile_vector(self.cost_prior)
                         if type(self.cost_prior) is CostProfile else _NO_PROFILE)
        depth = self.spec.max_depth
        self._offsets = _offsets(depth)
        self._state = np.zeros(self._offsets[-1])
        self._state[_SINCE_ACCEPT] = NEVER_MEASURED
        self._new_records = []
        self._held = []
        self._before_prefill = None
        self._restart = None
        if self.probe_tracker is not None:
            self.probe_tracker.reset(self.cost_prior is None)
        if not hasattr(self, "_inputs_cache"):  # spec and profile only: kept across resets
            # and shared by the builders of one spec and profile (a daemon's streams): the
            # first grid of each new stream cost ~200 us computing the same arrays again
            self._inputs_cache: dict[tuple, tuple] = _shared_inputs(self.spec, self.cost_prior)
            self._grid_key: np.ndarray | None = None
            self._grid_value: tuple = ()
        _solve(self._state, self._params, self.cost_prior is not None)

    def _copy_estimators(self) -> None:
        self._state = self._state.copy()

    def _set_switch(self, steps_used: int, since_switch: int) -> None:
        self._state[_STEPS_USED] = steps_used
        self._state[_SINCE_SWITCH] = since_switch

    def _fold_record(self, record) -> None:
        """Fold one step record into the estimators, now."""
        accepted = record.accepted_drafts
        if type(accepted) is not np.ndarray or accepted.dtype is not _INT8:
            accepted = _drafts(accepted)
        is_decode = record.prefill_tokens == 0
        prior_ms = 0.0
        has_prior = self.cost_prior is not None
        profile = self._profile
        if (has_prior and is_decode and record.step_latency_s > 0.0
                and profile is _NO_PROFILE):  # else the kernel computes it (_profile_ms)
            steps = min(max(record.steps_used, 0), self.spec.max_depth)
            prior_ms = 1e3 * self.cost_prior.step_latency_s(
                max(record.batch_size, 1), steps, record.kv_used_tokens, 0,
                draft_extend=steps > 0, speculative_path=steps > 0)
        tracker = self.probe_tracker
        if is_decode and type(tracker) is CompiledProbeTracker and tracker.spec.off_share:
            # The features' and the off probe's fold in one compiled call (the probe's
            # acceptance part, and the off part's rare step that needs a prediction, here).
            batch = max(record.batch_size, 1)
            if _fold_probed(self._state, self._params, has_prior, record.batch_size,
                            record.waiting_requests, record.kv_used_tokens,
                            record.kv_capacity_tokens, record.steps_used, accepted,
                            record.step_latency_s, prior_ms, profile,
                            record.warmup is True, tracker.off, tracker.settings):
                tracker.off_due(self, batch)
            tracker.fold_acceptance(record.steps_used, record.step_latency_s, self, batch)
            return
        _fold(self._state, self._params, has_prior, is_decode, record.batch_size,
              record.waiting_requests, record.kv_used_tokens, record.kv_capacity_tokens,
              record.steps_used, accepted, record.step_latency_s, prior_ms, profile,
              record.warmup is True)
        if is_decode and tracker is not None:
            if type(tracker) is CompiledProbeTracker:  # no off probe (else above): its
                # acceptance part alone, without fold's Python frame
                tracker.fold_acceptance(record.steps_used, record.step_latency_s, self,
                                        max(record.batch_size, 1))
            else:
                tracker.fold(record.steps_used, record.step_latency_s, self,
                             max(record.batch_size, 1))

    @staticmethod
    def _batch(builders, batch_sizes: np.ndarray) -> _Batch:
        first = builders[0]
        spec = first.spec
        depth = spec.max_depth
        n, rows = len(builders), len(batch_sizes)
        # np.array of the rows, not np.stack (the same copy, without stack's Python
        # checks: 2 vs 7 us for 5 streams)
        states = (first._state[None] if n == 1
                  else np.array([b._state for b in builders]))
        design, at0, slope, column0, buckets = first._grid_inputs(batch_sizes)
        out = np.empty((n, rows, spec.size), dtype=np.float32)
        latency = np.empty((depth + 1, n, rows))
        rates = np.empty((n, depth))
        expected = np.empty((n, depth + 1))
        _grids(states, first._params, first.cost_prior is not None, design, at0, slope,
               column0, buckets, out, latency, rates, expected)
        return _Batch(out, latency, rates, expected)

    def _grid_inputs(self, batch_sizes: np.ndarray) -> tuple[np.ndarray, ...]:
        """:meth:`_design`'s arrays (the prior's as 1 x 1 x 1 zeros without a profile),
        the vector's first column (log batch size, in the box) and each row's local
        cost bucket, per set of batch
        sizes; the spec's grid found by identity (see ``observation_grids``)."""
        if batch_sizes is self._grid_key:
            return self._grid_value
        key = tuple(batch_sizes.tolist())
        cached = self._inputs_cache.get(key)
        if cached is None:
            design, prior = self._design(batch_sizes)
            at0, slope = prior if prior is not None else (_NO_PRIOR, _NO_PRIOR)
            column0 = np.log1p(batch_sizes) / math.log1p(self.spec.batch_scale)
            column0 = np.maximum(np.minimum(column0, 1.0), -1.0)
            buckets = np.array([local_bucket(int(b)) for b in batch_sizes.tolist()],
                               dtype=np.int64)
            cached = self._inputs_cache[key] = (design, at0, slope, column0, buckets)
        if batch_sizes is self._layout.grid:  # read only: safe to know by identity
            self._grid_key, self._grid_value = batch_sizes, cached
        return cached

    def acceptance_age(self) -> tuple[int, bool]:
        state = self._state
        if state[self._offsets[0]] > 0.0:  # the first position's trials
            return int(state[_SINCE_ACCEPT]), True
        return int(state[_SINCE_ACCEPT]) - NEVER_MEASURED, False

    # -- the numpy builder's attributes, read from the state --------------------------

    @property
    def _waiting(self) -> int:
        return int(self._state[_WAITING])

    @property
    def _kv_use(self) -> float:
        return float(self._state[_KV_USE])

    @property
    def _kv_used_tokens(self) -> int:
        return int(self._state[_KV_TOKENS])

    @property
    def _batch_size(self) -> int:
        return int(self._state[_BATCH_SIZE])

    @property
    def _steps_used(self) -> int:
        return int(self._state[_STEPS_USED])

    @property
    def _steps_since_switch(self) -> int:
        return int(self._state[_SINCE_SWITCH])

    @property
    def _depth_samples(self) -> list[float]:
        start = self._offsets[2]
        return self._state[start:start + self.spec.max_depth + 1].tolist()

    @property
    def _prior_log_error(self) -> float:
        return float(self._state[_PRIOR_LOG_ERROR])

    @property
    def _latency_ms_ema(self) -> float | None:
        return float(self._state[_LATENCY_EMA]) if self._state[_HAS_LATENCY] else None

    @property
    def _theta(self) -> np.ndarray:
        start = self._offsets[4]
        return self._state[start:start + 7].copy()

    @_theta.setter
    def _theta(self, value: None) -> None:
        """Setting None solves the regression again (as the numpy builder would)."""
        if value is not None:
            raise ValueError("theta is computed, not set: assign None to solve again")
        _solve(self._state, self._params, self.cost_prior is not None)


_NO_PRIOR = np.zeros((1, 1, 1))
_INT8 = np.dtype(np.int8)
_NO_DRAFTS = np.zeros(0, dtype=_INT8)


def _drafts(accepted) -> np.ndarray:
    """Accepted drafts that are not already an int8 array, as np.bincount takes them:
    an integer array (of any integer type), or empty (of any type)."""
    accepted = np.asarray(accepted)
    if accepted.size == 0:
        return _NO_DRAFTS
    if accepted.dtype.kind not in "iu":  # np.bincount's error too
        raise TypeError(f"accepted_drafts must hold integers, got {accepted.dtype}")
    return accepted
