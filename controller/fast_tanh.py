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

:func:`forward_decide` runs the whole forward and the decision in one compiled call:
numpy's own ``cblas_sgemm`` called from the kernel for the products (the exact forward's
first layer bit for bit), the approximate ``tanh``, the arg-max over the allowed actions
and the unsure marks against :func:`products_tolerance` (which bounds the later layers'
products' rounding too). A daemon's poll after an idle millisecond runs with its caches
cold, where each of the exact forward's ten numpy calls costs 3-4x its warm cost.

Optional: without numba (or with ``SPECCTL_FAST_TANH=0`` in the environment) :data:`ENABLED`
is False and the deciders use the exact forward only; without numpy's bundled OpenBLAS
(:func:`forward_available`) they use the approximate forward through numpy calls.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np

try:
    from llvmlite import ir
    from numba import njit, types
    from numba.extending import intrinsic
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

    @intrinsic
    def _sgemm(typingctx, address, m, n, k, a, b, c):  # pragma: no cover - compiled
        """``c = a @ b`` for float32 row-major matrices (``a`` m x k, ``b`` k x n, ``c``
        m x n, each contiguous from its data pointer) through the ILP64 ``cblas_sgemm``
        at ``address``, with the arguments numpy's ``np.dot`` passes it (row-major, no
        transposes, alpha 1, beta 0, leading dimensions k, n, n)."""
        if not all(isinstance(t, types.Integer) for t in (address, m, n, k)):
            return None
        sig = types.void(address, m, n, k, a, b, c)

        def codegen(context, builder, signature, args):
            i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
            pointer = ir.IntType(8).as_pointer()
            function = ir.FunctionType(ir.VoidType(), [i32, i32, i32, i64, i64, i64, f32,
                                                       pointer, i64, pointer, i64, f32,
                                                       pointer, i64])
            size = [context.cast(builder, v, t, types.int64)
                    for v, t in zip(args[1:4], signature.args[1:4], strict=True)]
            data = [builder.bitcast(context.make_array(t)(context, builder, v).data, pointer)
                    for v, t in zip(args[4:], signature.args[4:], strict=True)]
            target = builder.inttoptr(
                context.cast(builder, args[0], signature.args[0], types.int64),
                function.as_pointer())
            row_major, no_transpose = ir.Constant(i32, 101), ir.Constant(i32, 111)
            builder.call(target, [row_major, no_transpose, no_transpose, *size,
                                  ir.Constant(f32, 1.0), data[0], size[2], data[1], size[1],
                                  ir.Constant(f32, 0.0), data[2], size[1]])
            return context.get_dummy_value()

        return sig, codegen

    @njit(cache=True)
    def _product_kernel(address, a, b):  # pragma: no cover - compiled
        out = np.empty((a.shape[0], b.shape[1]), dtype=np.float32)
        _sgemm(address, a.shape[0], b.shape[1], a.shape[1], a, b, out)
        return out

    @njit(fastmath={"contract"}, error_model="numpy", cache=True, inline="always")
    def _layer(address, src, w, b, out, hidden, pre, keep):  # pragma: no cover - compiled
        # out = act(src @ w + b): numpy's product (the same sgemm call), then numpy's
        # float32 sum, then the approximate tanh (hidden layers) as bias_tanh_inplace;
        # keep: the sums (pre-activations) kept in pre too, for the refined bound
        rows, width = out.shape
        _sgemm(address, rows, width, w.shape[0], src, w, out)
        if keep:
            for i in range(rows):
                for j in range(width):
                    v = out[i, j] + b[j]
                    pre[i, j] = v
                    out[i, j] = _tanh_one(v)
        elif hidden:
            for i in range(rows):
                for j in range(width):
                    out[i, j] = _tanh_one(out[i, j] + b[j])
        else:
            for i in range(rows):
                for j in range(width):
                    out[i, j] += b[j]

    @njit(error_model="numpy", cache=True, inline="always")
    def _refined_sure(logits, h, pre, i, allowed, best, refine, change
                      ):  # pragma: no cover - compiled
        # forward_decide's second look at a row the tolerance left unsure (see
        # forward_refinement): whether the best allowed logit's lower bound is above
        # every other allowed logit's upper bound, each bound the logit -/+ its own error
        hidden = refine.shape[0] - 1
        actions = logits.shape[1]
        g = refine[hidden, actions]
        for j in range(hidden):
            e = refine[j, actions]
            # tanh's slope on [z - e, z + e] is at most sech^2(|z| - e) <= 4 exp(-2(|z| - e))
            slope = min(1.0, 4.0 * np.exp(-2.0 * max(0.0, abs(float(pre[i, j])) - e)))
            change[j] = TANH_ERROR + e * slope
        lower = np.inf
        upper = -np.inf
        for a in range(actions):
            if not allowed[a]:
                continue
            carried = 0.0
            size = 0.0
            for j in range(hidden):
                w = refine[j, a]
                carried += w * change[j]
                size += abs(float(h[i, j])) * w
            error = ((1.0 + g) * carried + 2.0 * g * (size + refine[hidden, a])
                     + 2.0 * (hidden + 1) * 2.0 ** -149) * (1.0 + 1e-6)
            v = float(logits[i, a])
            if a == best:
                lower = v - error
            else:
                upper = max(upper, v + error)
        return upper < lower

    @njit(fastmath={"contract"}, error_model="numpy", cache=True)
    def _forward_decide_kernel(address, x, weights, biases, masks, rows, tol, refine
                               ):  # pragma: no cover - compiled
        # forward_decide's work, stream by stream (each stream's products the shape of
        # its own exact forward's: one grid's rows), then each row's allowed arg-max
        n = x.shape[0]
        streams = n // rows
        layers = len(weights)
        width = 1
        for layer in range(layers):
            width = max(width, weights[layer].shape[1])
        index = np.zeros((streams, rows), dtype=np.intp)
        unsure = np.zeros(streams, dtype=np.bool_)
        if not x.flags.c_contiguous:  # sgemm reads it row-major from its data pointer
            unsure[:] = True
            return index, unsure, streams
        one = np.empty(rows * width, dtype=np.float32)
        other = np.empty(rows * width, dtype=np.float32)
        last = np.empty(rows * width, dtype=np.float32)
        kept = np.empty(rows * width, dtype=np.float32)
        change = np.empty(width, dtype=np.float64)
        hidden = layers - 1
        count = 0
        for s in range(streams):
            # the hidden layers into one, other, one, ...; the logits into last
            w = weights[0]
            out = (last if hidden == 0 else one)[:rows * w.shape[1]].reshape(rows, w.shape[1])
            pre = kept[:rows * w.shape[1]].reshape(rows, w.shape[1])
            _layer(address, x[s * rows:(s + 1) * rows], w, biases[0], out, hidden > 0,
                   pre, hidden == 1)
            h = out
            for layer in range(1, layers):
                w = weights[layer]
                h = out
                target = last if layer == hidden else (other if layer % 2 else one)
                out = target[:rows * w.shape[1]].reshape(rows, w.shape[1])
                if layer == hidden - 1:
                    pre = kept[:rows * w.shape[1]].reshape(rows, w.shape[1])
                _layer(address, h, w, biases[layer], out, layer < hidden, pre,
                       layer == hidden - 1)
            allowed = masks[s if masks.shape[0] > 1 else 0]
            for i in range(rows):
                top = -np.inf
                second = -np.inf
                best = 0
                odd = False
                for a in range(out.shape[1]):
                    if not allowed[a]:
                        continue
                    v = float(out[i, a])
                    if v != v:
                        odd = True
                    elif v > top:
                        second = top
                        top = v
                        best = a
                    elif v > second:
                        second = v
                index[s, i] = best
                # unsure as in _decide_kernel, unless the row's own bound says sure
                if odd or top == np.inf or top == -np.inf or (
                        not top - second > tol
                        and (hidden == 0
                             or not _refined_sure(out, h, pre, i, allowed, best, refine,
                                                  change))):
                    unsure[s] = True
                    count += 1
                    break
        return index, unsure, count

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
    _all_finite_kernel = _forward_decide_kernel = _product_kernel = None


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


#: float32's unit roundoff (half its machine epsilon).
_UNIT = 2.0 ** -24


def _numpy_sgemm() -> int:
    """The address of the ILP64 ``cblas_sgemm`` in the OpenBLAS that numpy's wheels
    bundle (the one ``np.dot`` calls), or 0: another numpy build (its BLAS not found
    here, or an LP64 one) leaves :func:`forward_decide` off."""
    package = Path(np.__file__).parent
    for folder in (package.parent / "numpy.libs", package / ".libs", package / ".dylibs"):
        for path in sorted(folder.glob("*openblas64*")) if folder.is_dir() else ():
            try:
                library = ctypes.CDLL(str(path))
            except OSError:
                continue
            for name in ("scipy_cblas_sgemm64_", "cblas_sgemm64_"):
                function = getattr(library, name, None)
                if function is not None:
                    return ctypes.cast(function, ctypes.c_void_p).value or 0
    return 0


#: Where forward_decide's kernel calls sgemm (0: not here); checked once (_forward_ok).
_SGEMM = _numpy_sgemm() if available() else 0
_forward_ok: bool | None = None


def forward_available() -> bool:
    """Whether :func:`forward_decide` runs here: the kernels on (:data:`ENABLED`),
    numpy's own ``cblas_sgemm`` found, and its products through the kernel equal to
    ``np.dot``'s bit for bit on a few shapes (checked at the first call; a numpy whose
    ``dot`` goes elsewhere fails it)."""
    global _forward_ok
    if not ENABLED:  # read at every call: tests turn it off and on
        return False
    if _forward_ok is None:
        _forward_ok = bool(_SGEMM) and _products_are_numpys()
    return _forward_ok


def _products_are_numpys() -> bool:
    rng = np.random.default_rng(0)
    for m, k, n in ((20, 48, 64), (20, 64, 64), (20, 64, 8), (40, 128, 128), (3, 5, 2)):
        a = rng.standard_normal((m, k)).astype(np.float32)
        b = rng.standard_normal((k, n)).astype(np.float32)
        if not np.array_equal(_product_kernel(_SGEMM, a, b).view(np.uint32),
                              np.dot(a, b).view(np.uint32)):
            return False
    return True


def products_tolerance(weights: list[np.ndarray], biases: list[np.ndarray]) -> float:
    """How far apart a row's best two logits from :func:`forward_decide` must be for the
    exact forward (:meth:`ExportedPolicy.logits <controller.policy_file.ExportedPolicy.
    logits>` on the stream's grid) to rank them the same: :func:`tolerance`'s argument
    with the later layers' products' rounding bounded too.

    The first layer's product is the exact forward's own, bit for bit (the same
    ``cblas_sgemm`` with the same arguments and the same grid's rows; :func:`forward_
    available` checks it), and so is its bias sum. From then on the two forwards' inputs
    differ (the approximate ``tanh``), so their products round differently: a float32
    sum of ``n`` products and a bias, in any order (BLAS's blocking, fused multiply-adds),
    is within ``gamma(n + 1) (sum_k |h_k| |w_kj| + |b_j|)`` of the true value, ``gamma(m)
    = m u / (1 - m u)``, ``u`` = 2^-24 (Higham, *Accuracy and Stability of Numerical
    Algorithms*, 2nd ed., eq. 3.5), and ``|h| <= 1`` after either ``tanh``. Per unit
    ``j`` of layer ``l >= 1``, with ``d`` the bound on the previous activations'
    difference (``d = TANH_ERROR`` after the first layer):

        e_lj = sum_k |w_kj| d_k + 2 gamma(n_l + 1) (sum_k |w_kj| + |b_j|) + 2 (n_l + 1) 2^-149

    (the inputs' difference through the true product; both roundings; underflow's
    absolute error), and ``d = e + TANH_ERROR`` after a hidden layer's ``tanh``. Two
    logits move apart by at most twice the largest ``e`` of the last layer; computed in
    float64 and raised by a millionth for that arithmetic's rounding. (No sum overflows:
    its terms are at most ``sum_k |w_kj| + |b_j|``.) It is 7.6x :func:`tolerance` for
    ``ExportedPolicy.random(seed=1)`` (64-unit layers: 0.0010) and 14x for the shipped
    policy (128-unit: 0.12); measured differences are ~2e-6 (docs/ONLINE.md, twenty-fifth
    pass)."""
    if len(weights) < 2:
        return 0.0  # no hidden layer: the logits are the exact forward's bits
    last = _next_error(_hidden_error(weights, biases), weights[-1], biases[-1])
    return 2.0 * float(last.max()) * (1.0 + 1e-6)


def _gamma(m: int) -> float:
    return m * _UNIT / (1.0 - m * _UNIT)


def _next_error(change: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """products_tolerance's ``e`` of a layer from the one before's (per unit)."""
    w = np.abs(np.asarray(w, dtype=np.float64))
    b = np.abs(np.asarray(b, dtype=np.float64)).reshape(-1)
    return ((change + TANH_ERROR) @ w + 2.0 * _gamma(w.shape[0] + 1) * (w.sum(axis=0) + b)
            + 2.0 * (w.shape[0] + 1) * 2.0 ** -149)


def _hidden_error(weights: list[np.ndarray], biases: list[np.ndarray]) -> np.ndarray:
    """products_tolerance's ``e`` of the last hidden layer's pre-activations (the first
    layer's: zero, the exact forward's bits)."""
    change = np.zeros(np.shape(weights[0])[1])
    for w, b in zip(weights[1:-1], biases[1:-1], strict=True):
        change = _next_error(change, w, b)
    return change


def forward_refinement(weights: list[np.ndarray], biases: list[np.ndarray]) -> np.ndarray:
    """What :func:`forward_decide` needs for a row :func:`products_tolerance` leaves
    unsure, packed in one float64 array (one argument to unbox, not four): rows
    ``0..n-1`` (the last hidden layer's ``n`` units) hold the last layer's ``|w_ja|``
    and, in the last column, ``e_j`` of the unit's pre-activation (products_tolerance's
    bound); row ``n`` holds ``|b_a|`` and ``gamma(n + 1)``.

    The second look, per row, bounds each logit on its own instead of the worst case over
    all of them. The compiled pre-activation ``z_j`` is known, and the exact one lies
    within ``e_j`` of it; ``tanh``'s slope there is at most ``sech^2(max(0, |z_j| -
    e_j)) <= min(1, 4 exp(-2 max(0, |z_j| - e_j)))``, so the two forwards' activations
    differ by at most ``d_j = TANH_ERROR + e_j min(1, 4 exp(...))`` (a saturated unit
    carries almost none of ``e_j``). Logit ``a`` then differs by at most ``(1 + g) sum_j
    |w_ja| d_j + 2 g (sum_j |h_j| |w_ja| + |b_a|)`` (``g = gamma(n + 1)``, ``h`` the
    compiled activations: the exact ones are within ``d``; the first term the carried
    difference and the exact side's extra rounding of it), plus underflow's ``2 (n + 1)
    2^-149``, raised by a millionth. The row is sure when its best allowed logit minus
    its bound exceeds every other allowed logit plus its own. On the telemetry ab_daemon
    feeds it leaves 3.7% of the shipped policy's streams unsure where the tolerance left
    14% (docs/ONLINE.md, twenty-fifth pass)."""
    last = np.abs(np.asarray(weights[-1], dtype=np.float64))
    hidden, actions = last.shape
    out = np.zeros((hidden + 1, actions + 1))
    out[:hidden, :actions] = last
    if len(weights) > 1:
        out[:hidden, actions] = _hidden_error(weights, biases)
    out[hidden, :actions] = np.abs(np.asarray(biases[-1], dtype=np.float64)).reshape(-1)
    out[hidden, actions] = _gamma(hidden + 1)
    return out


def forward_decide(x: np.ndarray, weights: tuple[np.ndarray, ...],
                   biases: tuple[np.ndarray, ...], masks: np.ndarray, rows: int,
                   tol: float, refine: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """The ``tanh`` MLP and the decision in one compiled call: ``(index, unsure,
    count)``, the first two as :func:`decide_rows` gives on :meth:`approximate_logits
    <controller.policy_file.ExportedPolicy.approximate_logits>` (``index`` of shape
    (streams, ``rows``)), for float32 observations ``x`` (``rows`` per stream; not
    C-contiguous: every stream unsure), float32 C-contiguous layers (every dimension at
    least 2: numpy's ``dot`` is then ``cblas_sgemm``), ``masks`` (bool, C-contiguous, a
    row per stream or one for all; False: the action is not allowed) and ``tol``
    (:func:`products_tolerance`; a row within it gets a second look with ``refine``,
    :func:`forward_refinement`'s). Each stream's products are numpy's BLAS calls made from
    the kernel, its hidden ``tanh`` the approximate one. A stream not marked unsure has
    in every row the exact forward's arg-max over its allowed actions; a marked one's
    rows are partly unset: the caller decides them again; ``count`` is how many are
    marked. Needs :func:`forward_available`.

    One call instead of the exact forward's eight numpy calls (three ``dot``, three bias
    sums, two ``tanh``) and its arg-max: each of those costs 3-4x more after a
    millisecond idle (docs/ONLINE.md, twenty-fourth pass), how a 1-kHz daemon's polls
    run."""
    return _forward_decide_kernel(_SGEMM, x, weights, biases, masks, rows, tol, refine)


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
    if not forward_available():  # compiles the product check's kernel on the way
        return
    for layers in (2, 3):  # one and two hidden layers (numba builds per tuple length)
        weights = tuple(np.zeros((2, 2), dtype=np.float32) for _ in range(layers))
        biases = tuple(np.zeros(2, dtype=np.float32) for _ in range(layers))
        forward_decide(np.zeros((2, 2), dtype=np.float32), weights, biases,
                       np.ones((1, 2), dtype=bool), 1, 0.0, forward_refinement(weights, biases))
