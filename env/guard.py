"""The goodput guard: no speculation where the features say, with measured costs and a
profile the measurements confirm, that it does not pay.

The shipped policy sometimes speculates against its own observation: on ``h100_acc1.3``
at one client (``specctl-eval seed=0``, swapped profile) the features price depth 1 at
0.8-1.0 of off's goodput with both costs measured (truly 0.71-0.73), and the policy
alternates one step at depth 1 with two off (0.959x no speculation); on
``moe_h200_acc2.5`` (azure_conv, load 1.5, swapped) it runs depth 1 on 39% of the steps
priced at 0.36-0.6 of off (0.943x; the guard stands aside there: that profile is far
off, below). Its probability of the speculative choice there is
about 0.5-0.6: a marginal arg-max the observation does not support (``docs/POLICY.md``,
eleventh session).

The guard is a deterministic rule over the decision table, read from the observation
rows the policy decided on (so the simulator's policy adapter, ``specctl-serve`` and
local mode apply it identically): a row whose chosen depth ``d > 0`` has an estimated
goodput below ``1 - margin`` of off's (the row's ``relative_goodput_d``), with the cost
of both depth ``d`` and depth 0 measured recently (``cost_confidence`` at least
``confidence``: about 1.4 recent steps each, forgotten as the latency regression
forgets) and the measured latencies within ``max_profile_error`` (a mean log ratio) of
the handed profile's predictions, is set to off. Where either cost is the prior's guess
the policy's choice stands: measuring an unknown cost is the policy's business. Where the
profile is far off (another server's) the guard stands aside too: the latency
regression's residual over such a profile mispredicts a depth it ran a while ago by 2x
in either direction (on ``moe_h200_acc2.5`` at 64 clients it priced depth 2 below half
of off where depth 2 serves 1.03x off), and a guard acting there lost up to 0.15 of the
oracle on swapped-profile cells at seed 1. It runs before the acceptance probe
(:mod:`env.probe`), which may still turn an off row into a probe. Settings travel in the
policy file (``guard`` in its meta; absent: :data:`DEFAULT_GUARD`);
``specctl-serve guard.enabled=false``, ``SPECCTL_GUARD=0`` (local mode) and
``specctl-eval guard.enabled=false`` override them (and the other fields, but for
local mode's on/off), as the probe's are.

**The hopeless rule** (``hopeless`` > 0; 0, the default, is none) needs no measured cost: a
depth-d step commits at most 1 + d tokens, so a row whose chosen depth is priced above
``hopeless * (1 + d)`` times off cannot pay at any acceptance unless the price is wrong by
that factor. With a profile handed and the measurements near it (``max_profile_error``,
as above) such a row runs off. On a random server at seed 28 (``specctl-eval``, perturbed
profile, batch 130) the shipped policy chose depth 6 twice in a 32-decision window where
it is priced at 8.8x off, before depth 6's cost was ever measured: 0.62 of the oracle
(``docs/results/hopeless28/``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from env.probe import RuleSpec

#: Rows losing to off judged one by one up to this many (beyond, whole-array).
_FEW = 4
#: Observation dtypes the compiled many-row guard takes (env.guard_compiled).
_COMPILED_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
#: The compiled guard's kernel once imported (None: numba is not installed); see _compiled.
_KERNEL: object = ...


#: The compiled guard's ``off_allowed`` when every stream may run off.
_EVERY = np.ones(0, dtype=bool)


@functools.lru_cache(maxsize=64)
def _limits(guard: GuardSpec, dtype: np.dtype) -> np.ndarray:
    """The compiled guard's constants in ``dtype``, as numpy compares a float32 array with
    a Python float (in float32): 3, log1p(-margin), confidence, max_profile_error."""
    limits = np.array([3.0, math.log1p(-guard.margin), guard.confidence,
                       guard.max_profile_error], dtype=dtype)
    limits.flags.writeable = False  # shared by every call with this guard
    return limits


def _compiled():
    """:func:`env.guard_compiled.guard_kernel`, imported at the first many-row guard (numba
    is optional), or None without numba."""
    global _KERNEL
    if _KERNEL is ...:
        try:
            from env.guard_compiled import guard_kernel
        except ImportError:
            guard_kernel = None
        _KERNEL = guard_kernel
    return _KERNEL


@dataclass(frozen=True)
class GuardSpec(RuleSpec):
    """When a speculative choice the features price below off becomes off."""

    label: ClassVar[str] = "guard"

    #: Off: the policy's decisions unchanged.
    enabled: bool = True
    #: A depth whose estimated goodput is below ``1 - margin`` of off's is overruled. A
    #: negative margin overrules ties too: the shipped policy's -0.02 runs off unless a
    #: depth is priced at least 2% above off (the same tokens for less GPU work; at
    #: ``specctl-eval`` seeds 0-2 two more never-pays windows each, every cell kept).
    margin: float = 0.1
    #: Cost confidence (``1 - exp(-samples / 2)``) both depths need for the guard to act.
    confidence: float = 0.5
    #: The guard acts only while the measured latencies sit within this of the handed
    #: profile's predictions (the observation's ``cost_profile_error``, a mean log ratio
    #: clipped to [-1, 1]; 1: always): with a profile far off (another server's), the
    #: latency regression's prediction of a depth it ran long ago is far off too. With
    #: the features' local measured-cost correction (``FeatureSpec.latency_local_samples``)
    #: the costs compared near the batch are the measured ones: the fourteenth session's
    #: candidate sets 1.0 (docs/results/local_cost/).
    max_profile_error: float = 0.5
    #: The hopeless rule (0, the default, is none): in a stream with a cost profile that
    #: the measurements sit within ``max_profile_error`` of, a row whose chosen depth d is
    #: priced above ``hopeless * (1 + d)`` times off runs off, whatever the cost
    #: confidence: a depth-d step commits at most 1 + d tokens, so no acceptance makes it
    #: pay unless the profile is off by that factor (:func:`overrule_hopeless`).
    hopeless: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"guard.enabled: {self.enabled!r} is not true or false")
        hopeless = self.hopeless
        if isinstance(hopeless, bool) or not isinstance(hopeless, int | float) or not (
                hopeless == 0.0 or 1.0 <= hopeless < 20.0):
            raise ValueError(f"guard.hopeless: {hopeless!r} is not 0 or a number in [1, 20)")
        error = self.max_profile_error
        if isinstance(error, bool) or not isinstance(error, int | float) \
                or not 0.0 <= error <= 1.0:
            raise ValueError(f"guard.max_profile_error: {error!r} is not a number in [0, 1]")
        for name, low in (("margin", -0.5), ("confidence", 0.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) \
                    or not low < value < 1.0:
                raise ValueError(f"guard.{name}: {value!r} is not a number in ({low:g}, 1)")

    def to_dict(self) -> dict:
        """As :meth:`RuleSpec.to_dict`, without ``hopeless`` where it is 0 (a file written
        with it at 0 is byte for byte what it was before the field)."""
        data = super().to_dict()
        if self.hopeless == 0.0:
            del data["hopeless"]
        return data



#: The guard of a policy file that does not set one.
DEFAULT_GUARD = GuardSpec()
#: No guard: the policy's decisions unchanged.
NO_GUARD = GuardSpec(enabled=False)


class GuardColumns:
    """Where the guard reads a feature spec's observation vector (built once per spec)."""

    def __init__(self, names: list[str], max_depth: int) -> None:
        # Column of relative_goodput_d and cost_confidence_d per depth; depth 0 has no
        # goodput column (its entry is never read).
        goodput = [names.index(f"relative_goodput_{d}") for d in range(1, max_depth + 1)]
        self.goodput = np.array([goodput[0], *goodput])
        self.confidence = np.array([names.index(f"cost_confidence_{d}")
                                    for d in range(max_depth + 1)])
        self.profile_error = names.index("cost_profile_error")
        self.has_profile = names.index("has_cost_profile")
        #: Column of relative_latency_d per depth (depth 0: depth 1's, never read): the
        #: hopeless rule's and the start probe's (env.probe.could_pay).
        latency = [names.index(f"relative_latency_{d}") for d in range(1, max_depth + 1)]
        self.latency = np.array([latency[0], *latency])
        #: Per depth, the four columns a row choosing it is judged by (its goodput, its
        #: cost confidence, off's, the profile error): one gather per call.
        self.judged = np.stack([self.goodput, self.confidence,
                                np.full(max_depth + 1, self.confidence[0]),
                                np.full(max_depth + 1, self.profile_error)], axis=1)
        #: The same as plain ints, for the one-row path.
        self.judged_ints = [tuple(int(c) for c in row) for row in self.judged]
        #: goodput, confidence and the profile error's column in one array (the compiled
        #: many-row guard's argument, env.guard_compiled).
        self.packed = np.concatenate([self.goodput, self.confidence,
                                      [self.profile_error]]).astype(np.int64)


@functools.lru_cache(maxsize=16)
def guard_columns(spec) -> GuardColumns:
    """The :class:`GuardColumns` of a :class:`env.features.FeatureSpec` (cached)."""
    return GuardColumns(spec.names(), spec.max_depth)


def warm_up(spec) -> None:
    """Compile (or load from numba's cache) the many-row guard now, for float32
    observations of ``spec`` (a :class:`env.features.FeatureSpec`), not at the first
    decision; nothing without numba."""
    if _compiled() is None:
        return
    columns = guard_columns(spec)
    actions = np.arange(spec.max_depth + 1, dtype=np.int64)
    apply_guard(DEFAULT_GUARD, columns, np.zeros((2, spec.size), dtype=np.float32),
                np.ones((1, 2), dtype=np.intp), actions, [None])


def guard_rows(guard: GuardSpec, columns: GuardColumns, observations: np.ndarray,
               index: np.ndarray, actions: np.ndarray, off_index: int | None) -> None:
    """In place: the entries of ``index`` (action indices, any shape; ``observations``
    the matching rows, shape (index.size, size)) the guard overrules become
    ``off_index`` (the policy's action 0; None: it has none, nothing changes).

    A row is overruled where its chosen depth ``d > 0`` has ``relative_goodput_d * 3 <
    log1p(-margin)``, both ``cost_confidence_d`` and ``cost_confidence_0`` at least
    ``confidence`` (the smaller of the two: a NaN in either fails) and
    ``|cost_profile_error| <= max_profile_error``, each computed in the observations'
    dtype. One row (the simulator's adapter, every step) is judged on scalars; more by
    their goodput first, the rest read only for the rows that lose (on scalars too when
    they are few)."""
    if not guard.enabled or off_index is None:
        return
    if index.size == 1:
        chosen = actions[index.flat[0]]
        if chosen <= 0:
            return
        judged = columns.judged_ints[chosen]
        row = observations[0]
        # The same arithmetic on the same dtype as below, one scalar at a time.
        if row[judged[0]] * 3.0 < math.log1p(-guard.margin) and _sure(guard, row, judged):
            index.flat[0] = off_index
        return
    steps = actions[index.ravel()]
    rows = (steps > 0).nonzero()[0]
    if not rows.size:
        return
    chosen = steps[rows]
    # relative_goodput_d is log(goodput_d / goodput_0) / 3, clipped to [-1, 1]. Most rows
    # price their choice above off's: the rest is read only for those that do not.
    losing = observations[rows, columns.goodput[chosen]] * 3.0 < math.log1p(-guard.margin)
    if not losing.any():
        return
    rows = rows[losing]
    if rows.size <= _FEW:  # each numpy call below costs more than judging a row
        for row, depth in zip(rows.tolist(), chosen[losing].tolist(), strict=True):
            if _sure(guard, observations[row], columns.judged_ints[depth]):
                index.flat[row] = off_index
        return
    judged = observations[rows[:, None], columns.judged[chosen[losing]]]
    confidence = guard.confidence
    overruled = rows[(judged[:, 1] >= confidence) & (judged[:, 2] >= confidence)
                     & (np.abs(judged[:, 3]) <= guard.max_profile_error)]
    index.flat[overruled] = off_index


def _sure(guard: GuardSpec, row: np.ndarray, judged: tuple[int, int, int, int]) -> bool:
    """Whether a row losing to off is sure enough to overrule: both costs measured, the
    profile near (``judged``: its four columns, see :attr:`GuardColumns.judged`)."""
    return (row[judged[1]] >= guard.confidence and row[judged[2]] >= guard.confidence
            and abs(row[judged[3]]) <= guard.max_profile_error)


def off_index(actions: np.ndarray) -> int | None:
    """Index of the action 0 (no speculation) in ``actions``, None if there is none."""
    return _off_index(tuple(np.asarray(actions).tolist()))


@functools.lru_cache(maxsize=16)
def _off_index(actions: tuple) -> int | None:
    # Cached by value: a policy's actions are the same at every call (the search costs
    # a few numpy calls, the key a list and a tuple of a few ints).
    return next((i for i, action in enumerate(actions) if action == 0), None)


#: numpy's intp dtype: numpy's own arrays of it hold this one object (identity is one
#: pointer compare; ``dtype == np.intp`` converts np.intp to a dtype every call); numba's
#: (controller.fast_tanh.decide_rows') an equal other: compared by value.
_INTP = np.dtype(np.intp)
#: The latest :func:`_compiled_settings` answer with its arguments, held (so no other
#: object can take their ids): (guard, actions, observation dtype, settings).
_latest_settings: tuple = (None, None, None, None)


def _compiled_settings(guard: GuardSpec, actions: np.ndarray, dtype: np.dtype
                       ) -> tuple[int, np.ndarray] | None:
    """The compiled guard's (off index, limits) for ``guard`` over ``actions`` and
    observations of ``dtype``, or None where it does not apply (no action 0, dtypes it
    does not take). A decider asks with the same three objects poll after poll: the
    latest answer is kept by identity (``actions``, as everywhere here, is read only),
    not looked up by value: ``off_index``'s key and ``_limits``' hash of the guard's
    fields were ~5 us of a one-stream poll after a millisecond idle (docs/ONLINE.md,
    twenty-fourth pass)."""
    global _latest_settings
    latest = _latest_settings
    if latest[0] is guard and latest[1] is actions and latest[2] is dtype:
        return latest[3]
    off = off_index(actions)
    settings = None
    if off is not None and dtype in _COMPILED_DTYPES and actions.dtype == np.int64:
        settings = (off, _limits(guard, dtype))
    _latest_settings = (guard, actions, dtype, settings)
    return settings


def apply_guard(guard: GuardSpec, columns: GuardColumns, observations: np.ndarray,
                index: np.ndarray, actions: np.ndarray,
                allowed: list[np.ndarray | None] | tuple) -> None:
    """In place: :func:`guard_rows` on each stream's rows of ``index`` (shape (streams,
    grid rows); ``observations`` shape (streams * grid rows, size)), where the server lets
    that stream run off (``allowed``: per stream a mask over ``actions`` or None); the one
    place both deciders and the simulator's policy adapter apply the guard."""
    if not guard.enabled:
        return
    kernel = _compiled()
    settings = _compiled_settings(guard, actions, observations.dtype)
    if (kernel is not None and settings is not None and index.ndim == 2 and index.size > 1
            and (index.dtype is _INTP or index.dtype == _INTP) and observations.ndim == 2
            and observations.shape[0] == index.size):
        # one compiled call (env.guard_compiled): the same rows overruled
        off, limits = settings
        flags = _EVERY
        for mask in allowed:
            if mask is not None:
                flags = np.fromiter((m is None or bool(m[off]) for m in allowed), bool,
                                    len(allowed))
                break
        kernel(observations, index, actions, off, flags, columns.packed, limits)
    else:
        off = off_index(actions)
        if off is None:
            return
        if all(mask is None or mask[off] for mask in allowed):
            guard_rows(guard, columns, observations, index, actions, off)
        else:
            rows = index.shape[1]
            for i, mask in enumerate(allowed):
                if mask is None or mask[off]:
                    guard_rows(guard, columns, observations[i * rows:(i + 1) * rows],
                               index[i], actions, off)
    if guard.hopeless:
        overrule_hopeless(guard, columns, observations, index, actions, allowed)


def overrule_hopeless(guard: GuardSpec, columns: GuardColumns, observations: np.ndarray,
                      index: np.ndarray, actions: np.ndarray,
                      allowed: list[np.ndarray | None] | tuple) -> None:
    """In place: the hopeless rule (:attr:`GuardSpec.hopeless`) on ``index`` (shape
    (streams, grid rows); ``observations`` one row per entry), where the server lets the
    stream run off: an entry whose action d > 0 is priced above ``hopeless * (1 + d)``
    times off (``3 * relative_latency_d``, capped at log 20) in a row with a cost profile
    and ``|cost_profile_error| <= max_profile_error`` becomes off."""
    off = off_index(actions)
    if off is None:
        return
    chosen = actions[index.reshape(-1)]
    rows = np.arange(chosen.size)
    slower = 3.0 * observations[rows, columns.latency[np.maximum(chosen, 1)]]
    hopeless = ((chosen > 0) & (slower > np.log(guard.hopeless * (1.0 + chosen)))
                & (observations[:, columns.has_profile] > 0.5)
                & (np.abs(observations[:, columns.profile_error]) <= guard.max_profile_error))
    if not hopeless.any():
        return
    per_stream = index.shape[1] if index.ndim == 2 else chosen.size
    for i, mask in enumerate(allowed):
        if mask is not None and not mask[off]:
            hopeless[i * per_stream:(i + 1) * per_stream] = False
    index[hopeless.reshape(index.shape)] = off
