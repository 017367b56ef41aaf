"""A cheaper float32 ``tanh`` for the policy's hidden layers, and the check that keeps
every decision the exact forward's.

numpy's float32 ``tanh`` was ~60% of a policy forward on this project's machines (2.7 ns
an element on the AVX2 hosts of the fifteenth to nineteenth sessions: a table lookup per
element through vector gathers, slow on those cores). :func:`tanh_inplace` computes it
from ``exp(-2|x|)`` (range reduction by ``k ln 2``, a degree-7 polynomial, the power of
two made exactly by selects), compiled with numba: ~3x cheaper, and within
:data:`TANH_ERROR` of numpy's value for every float32 (``benchmarks/tanh_error.py``
checks all 2^32 of them).

The logits it gives differ from the exact forward's in the last bits, and an arg-max
could differ where a row's two best logits nearly tie. So :func:`unsure_streams` marks
every stream with a row whose two best (allowed) logits are within the policy's
tolerance (:func:`tolerance`: twice the largest logit change that :data:`TANH_ERROR` per
hidden activation can make, worst case through the weights' absolute values), and the
caller (:func:`controller.decider.evaluate`) recomputes those streams' grids with the
exact forward. Every other row's top logit leads by more than the approximation can
move two logits apart: its decision is the exact forward's.

Optional: without numba (or with ``SPECCTL_FAST_TANH=0`` in the environment) :data:`ENABLED`
is False and the deciders use the exact forward only.
"""

from __future__ import annotations

import os

import numpy as np

try:
    from numba import njit
except ImportError:  # numba is optional (see pyproject.toml)
    njit = None

#: Bound on ``|tanh_inplace(x) - np.tanh(x)|`` over every float32 ``x``, plus twice
#: numpy's own error against the true ``tanh`` (the tolerance's argument uses both;
#: see :func:`tolerance`). Measured over all 2^32 float32 values
#: (``benchmarks/tanh_error.py``, docs/ONLINE.md nineteenth pass): the kernel differs
#: from numpy by at most ~1.2e-7 and numpy from float64 ``tanh`` by ~6e-8; this is
#: more than twice their sum.
TANH_ERROR = 1e-6
if njit is not None:
    _F = np.float32
    _LN2_HI = _F(0.693359375)  # ln 2 split (Cody and Waite): k * _LN2_HI is exact
    _LN2_LO = _F(-2.12194440e-4)
    _LOG2E = _F(1.44269504)

    @njit(fastmath={"contract"}, error_model="numpy", cache=True)
    def _tanh_kernel(flat: np.ndarray) -> None:  # pragma: no cover - compiled
        one, zero = _F(1.0), _F(0.0)
        for i in range(flat.size):
            x = flat[i]
            # tanh(|x|) = (1 - e) / (1 + e), e = exp(-2|x|); beyond 9 float32 rounds to 1
            z = min(abs(x), _F(9.0))
            z = z + z
            k = np.int32(z * _LOG2E + _F(0.5))  # z >= 0: rounds to nearest
            kf = _F(k)
            r = (z - kf * _LN2_HI) - kf * _LN2_LO  # |r| <= ln(2) / 2 (about)
            p = one - r * (one - r * (_F(0.5) - r * (_F(1 / 6) - r * (
                _F(1 / 24) - r * (_F(1 / 120) - r * (_F(1 / 720) - r * _F(1 / 5040)))))))
            # 2^-k, k in [0, 26], from its bits: exact, and vectorisable (no table)
            s = (_F(0.5) if k & 1 else one) * (_F(0.25) if k & 2 else one)
            s = s * ((_F(0.0625) if k & 4 else one) * (_F(2.0 ** -8) if k & 8 else one))
            e = p * (s * (_F(2.0 ** -16) if k & 16 else one))
            t = (one - e) / (one + e)
            flat[i] = t if x >= zero else -t  # NaN stays NaN (then -NaN)

    @njit(fastmath={"contract"}, error_model="numpy", cache=True, inline="always")
    def _tanh_one(x):  # pragma: no cover - compiled
        # _tanh_kernel's element, line for line (tests compare the two bit for bit)
        one, zero = _F(1.0), _F(0.0)
        z = min(abs(x), _F(9.0))
        z = z + z
        k = np.int32(z * _LOG2E + _F(0.5))
        kf = _F(k)
        r = (z - kf * _LN2_HI) - kf * _LN2_LO
        p = one - r * (one - r * (_F(0.5) - r * (_F(1 / 6) - r * (
            _F(1 / 24) - r * (_F(1 / 120) - r * (_F(1 / 720) - r * _F(1 / 5040)))))))
        s = (_F(0.5) if k & 1 else one) * (_F(0.25) if k & 2 else one)
        s = s * ((_F(0.0625) if k & 4 else one) * (_F(2.0 ** -8) if k & 8 else one))
        e = p * (s * (_F(2.0 ** -16) if k & 16 else one))
        t = (one - e) / (one + e)
        return t if x >= zero else -t

    @njit(fastmath={"contract"}, error_model="numpy", cache=True)
    def _bias_tanh_kernel(x: np.ndarray, bias: np.ndarray) -> None:
        # pragma: no cover - compiled
        rows, width = x.shape
        for i in range(rows):
            for j in range(width):
                x[i, j] = _tanh_one(x[i, j] + bias[j])  # float32 + float32: numpy's sum

    @njit(error_model="numpy", cache=True)
    def _decide_kernel(logits: np.ndarray, rows: int, tol: float
                       ) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover - compiled
        # _unsure_kernel's marks, and each row's arg-max (its first best) on the way
        streams = logits.shape[0] // rows
        width = logits.shape[1]
        index = np.zeros(logits.shape[0], dtype=np.intp)
        out = np.zeros(streams, dtype=np.bool_)
        for s in range(streams):
            for r in range(s * rows, (s + 1) * rows):
                top = -np.inf
                second = -np.inf
                best = 0
                odd = False
                for a in range(width):
                    v = float(logits[r, a])
                    if v != v:
                        odd = True
                    elif v > top:
                        second = top
                        top = v
                        best = a
                    elif v > second:
                        second = v
                index[r] = best
                if odd or top == np.inf or top == -np.inf or not top - second > tol:
                    out[s] = True
                    break  # the caller decides this stream's rows again, exactly
        return index, out

    @njit(error_model="numpy", cache=True)
    def _unsure_kernel(logits: np.ndarray, rows: int, tol: float) -> np.ndarray:
        # pragma: no cover - compiled
        streams = logits.shape[0] // rows
        width = logits.shape[1]
        out = np.zeros(streams, dtype=np.bool_)
        for s in range(streams):
            for r in range(s * rows, (s + 1) * rows):
                top = -np.inf
                second = -np.inf
                odd = False
                for a in range(width):
                    v = float(logits[r, a])
                    if v != v:
                        odd = True
                    elif v > top:
                        second = top
                        top = v
                    elif v > second:
                        second = v
                # unsure: a NaN, no finite best, or the best two within the tolerance
                # (a tie included). float32 values subtract exactly in float64.
                if odd or top == np.inf or top == -np.inf or not top - second > tol:
                    out[s] = True
                    break
        return out
    @njit(error_model="numpy", cache=True)
    def _all_finite_kernel(x: np.ndarray) -> bool:  # pragma: no cover - compiled
        rows, width = x.shape
        for i in range(rows):
            for j in range(width):
                if not np.isfinite(x[i, j]):
                    return False
        return True
else:
    _tanh_kernel = _unsure_kernel = _bias_tanh_kernel = _decide_kernel = None
    _all_finite_kernel = None


def available() -> bool:
    """Whether the kernels exist here (numba imports)."""
    return _tanh_kernel is not None


#: Whether the deciders use the approximate forward: numba present, not turned off by
#: ``SPECCTL_FAST_TANH=0`` (read once, at import: reading the environment costs ~1 us).
ENABLED = available() and os.environ.get("SPECCTL_FAST_TANH", "1") != "0"


def tanh_inplace(x: np.ndarray) -> np.ndarray:
    """``x[:] = tanh(x)`` for a C-contiguous float32 array, within :data:`TANH_ERROR` of
    ``np.tanh``; returns ``x``. Needs numba (:func:`available`)."""
    _tanh_kernel(x.reshape(-1))
    return x


def unsure_streams(logits: np.ndarray, rows: int, tol: float) -> np.ndarray:
    """Per stream (``rows`` consecutive rows of ``logits`` each, float32 or float64,
    -inf where an action is not allowed): whether any of its rows' best two logits are
    within ``tol`` (or its row has a NaN, or no finite best): those rows' arg-max could
    differ from the exact forward's."""
    return _unsure_kernel(logits, rows, float(tol))


def bias_tanh_inplace(x: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """``x[:] = tanh_inplace(x + bias)`` in one pass, bit for bit (the same float32 sum,
    then :func:`tanh_inplace`'s arithmetic), for a C-contiguous float32 matrix ``x`` and a
    float32 ``bias`` of its width; returns ``x``. Needs numba (:func:`available`)."""
    _bias_tanh_kernel(x, bias)
    return x


def decide_rows(logits: np.ndarray, rows: int, tol: float) -> tuple[np.ndarray, np.ndarray]:
    """:func:`unsure_streams`, and each row's arg-max, in one pass: ``(index, unsure)``,
    ``index`` of shape (streams, ``rows``). A stream not marked unsure has in every row a
    unique finite best, so its rows' ``index`` is ``logits.argmax(axis=1)``'s; an unsure
    stream's rows are left partly unset (0): the caller decides those again."""
    index, unsure = _decide_kernel(logits, rows, float(tol))
    return index.reshape(-1, rows), unsure


def all_finite(x: np.ndarray) -> bool:
    """``np.isfinite(x).all()`` for a 2-D float array, in one compiled call where numba
    is here: the decider's check of every grid before the forward. numpy's (a boolean
    temporary, then ``ndarray.all``'s Python-level wrapper and a reduction) took 15.6 us
    after a millisecond idle against 2.7 for a compiled call (4.6 against 1.5 warm):
    a 1-kHz server's polls run with the caches cold (docs/ONLINE.md, twenty-fourth pass)."""
    if _all_finite_kernel is None or x.ndim != 2:
        return bool(np.isfinite(x).all())
    return _all_finite_kernel(x)


def tolerance(weights: list[np.ndarray]) -> float:
    """How far apart a row's best two approximate logits must be for the exact forward to
    rank them the same: twice the largest change of one logit that an error of
    :data:`TANH_ERROR` in every hidden activation can make, propagated layer by layer
    through the weights' absolute values (``tanh`` moves no further than its input; the
    first layer's product is the exact forward's own).

    Not a proof for the later layers' products: the approximate activations go through
    the same float32 products as the exact ones and round differently (a few units in
    the last place, as the exact forward itself does between batch shapes: up to 1.7e-5
    for the shipped policy between a 1,280-row batch and one grid). :data:`TANH_ERROR`
    is four times the error it bounds and the worst case aligns every error, so the
    tolerance sits two to three orders of magnitude above the differences measured
    (docs/ONLINE.md, nineteenth pass: 9.5e-6 against 8.6e-3 for the shipped policy)."""
    change = 0.0  # bound on |approximate - exact| of the previous layer's activations
    for layer in range(1, len(weights)):
        column = np.abs(np.asarray(weights[layer], dtype=np.float64)).sum(axis=0)
        change = float(np.max(column) * (TANH_ERROR + change))
    return 2.0 * change


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernels now, for every dtype the
    deciders pass, not at the first decision."""
    if _tanh_kernel is None:
        return
    tanh_inplace(np.zeros((2, 2), dtype=np.float32))
    bias_tanh_inplace(np.zeros((2, 2), dtype=np.float32), np.zeros(2, dtype=np.float32))
    for dtype in (np.float32, np.float64):  # the logits as they come: C-contiguous
        unsure_streams(np.zeros((2, 2), dtype=dtype), 1, 0.0)
        decide_rows(np.zeros((2, 2), dtype=dtype), 1, 0.0)
        all_finite(np.zeros((2, 2), dtype=dtype))
        all_finite(np.zeros((2, 4), dtype=dtype)[:, ::2])  # a strided view: its own build
