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
profile is far off (another server's) the guard stands aside too, and (with
``max_prefill_share`` below 1) where nearly every recent record was a prefill: the latency
regression's residual over such a profile mispredicts a depth it ran a while ago by 2x
in either direction (on ``moe_h200_acc2.5`` at 64 clients it priced depth 2 below half
of off where depth 2 serves 1.03x off), and a guard acting there lost up to 0.15 of the
oracle on swapped-profile cells at seed 1. It runs before the acceptance probe
(:mod:`env.probe`), which may still turn an off row into a probe. Settings travel in the
policy file (``guard`` in its meta; absent: :data:`DEFAULT_GUARD`);
``specctl-serve guard.enabled=false``, ``SPECCTL_GUARD=0`` (local mode) and
``specctl-eval guard.enabled=false`` override them (and the other fields, but for
local mode's on/off), as the probe's are.
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
    #: The guard acts only while the observation's ``prefill_share`` (the share of recent
    #: records that were prefill steps) is at most this (1: always, as before the
    #: nineteenth session). Where nearly every record is a prefill (a burst of long
    #: prompts) the time between decode steps is mostly prefill, which every depth pays
    #: alike: a depth priced per decode step near off's serves more per second than off
    #: (``random-0``/azure_code at ``specctl-eval seed=4``: depth 1 priced 1.4-1.8% above
    #: off at prefill share 0.99, overruled, 0.94 of the oracle against 1.01 without the
    #: guard; docs/results/cells19/).
    max_prefill_share: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"guard.enabled: {self.enabled!r} is not true or false")
        for name in ("max_profile_error", "max_prefill_share"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) \
                    or not 0.0 <= value <= 1.0:
                raise ValueError(f"guard.{name}: {value!r} is not a number in [0, 1]")
        for name, low in (("margin", -0.5), ("confidence", 0.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) \
                    or not low < value < 1.0:
                raise ValueError(f"guard.{name}: {value!r} is not a number in ({low:g}, 1)")



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
        self.prefill_share = names.index("prefill_share")
        #: Per depth, the four columns a row choosing it is judged by (its goodput, its
        #: cost confidence, off's, the profile error): one gather per call.
        self.judged = np.stack([self.goodput, self.confidence,
                                np.full(max_depth + 1, self.confidence[0]),
                                np.full(max_depth + 1, self.profile_error)], axis=1)
        #: The same as plain ints, for the one-row path.
        self.judged_ints = [tuple(int(c) for c in row) for row in self.judged]


@functools.lru_cache(maxsize=16)
def guard_columns(spec) -> GuardColumns:
    """The :class:`GuardColumns` of a :class:`env.features.FeatureSpec` (cached)."""
    return GuardColumns(spec.names(), spec.max_depth)


def guard_rows(guard: GuardSpec, columns: GuardColumns, observations: np.ndarray,
               index: np.ndarray, actions: np.ndarray, off_index: int | None) -> None:
    """In place: the entries of ``index`` (action indices, any shape; ``observations``
    the matching rows, shape (index.size, size)) the guard overrules become
    ``off_index`` (the policy's action 0; None: it has none, nothing changes).

    A row is overruled where its chosen depth ``d > 0`` has ``relative_goodput_d * 3 <
    log1p(-margin)``, both ``cost_confidence_d`` and ``cost_confidence_0`` at least
    ``confidence`` (the smaller of the two: a NaN in either fails),
    ``|cost_profile_error| <= max_profile_error`` and (where ``max_prefill_share < 1``)
    ``prefill_share <= max_prefill_share``, each computed in the observations' dtype. One
    row (the simulator's adapter, every step) is judged on scalars; more by their goodput
    first, the rest read only for the rows that lose (on scalars too when they are
    few)."""
    if not guard.enabled or off_index is None:
        return
    if index.size == 1:
        chosen = actions[index.flat[0]]
        if chosen <= 0:
            return
        judged = columns.judged_ints[chosen]
        row = observations[0]
        # The same arithmetic on the same dtype as below, one scalar at a time.
        if row[judged[0]] * 3.0 < math.log1p(-guard.margin) and _sure(guard, row, judged) \
                and _decode_bound(guard, row, columns):
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
            if _sure(guard, observations[row], columns.judged_ints[depth]) \
                    and _decode_bound(guard, observations[row], columns):
                index.flat[row] = off_index
        return
    judged = observations[rows[:, None], columns.judged[chosen[losing]]]
    confidence = guard.confidence
    sure = ((judged[:, 1] >= confidence) & (judged[:, 2] >= confidence)
            & (np.abs(judged[:, 3]) <= guard.max_profile_error))
    if guard.max_prefill_share < 1.0:
        sure &= observations[rows, columns.prefill_share] <= guard.max_prefill_share
    index.flat[rows[sure]] = off_index


def _sure(guard: GuardSpec, row: np.ndarray, judged: tuple[int, int, int, int]) -> bool:
    """Whether a row losing to off is sure enough to overrule: both costs measured, the
    profile near (``judged``: its four columns, see :attr:`GuardColumns.judged`)."""
    return (row[judged[1]] >= guard.confidence and row[judged[2]] >= guard.confidence
            and abs(row[judged[3]]) <= guard.max_profile_error)


def _decode_bound(guard: GuardSpec, row: np.ndarray, columns: GuardColumns) -> bool:
    """Whether a row's recent records were prefill steps at most ``max_prefill_share`` of
    the time (always where it is 1, whatever the row holds)."""
    return guard.max_prefill_share >= 1.0 or row[columns.prefill_share] <= guard.max_prefill_share


def off_index(actions: np.ndarray) -> int | None:
    """Index of the action 0 (no speculation) in ``actions``, None if there is none."""
    return _off_index(tuple(np.asarray(actions).tolist()))


@functools.lru_cache(maxsize=16)
def _off_index(actions: tuple) -> int | None:
    # Cached by value: a policy's actions are the same at every call (the search costs
    # a few numpy calls, the key a list and a tuple of a few ints).
    return next((i for i, action in enumerate(actions) if action == 0), None)


def apply_guard(guard: GuardSpec, columns: GuardColumns, observations: np.ndarray,
                index: np.ndarray, actions: np.ndarray,
                allowed: list[np.ndarray | None] | tuple) -> None:
    """In place: :func:`guard_rows` on each stream's rows of ``index`` (shape (streams,
    grid rows); ``observations`` shape (streams * grid rows, size)), where the server lets
    that stream run off (``allowed``: per stream a mask over ``actions`` or None); the one
    place both deciders and the simulator's policy adapter apply the guard."""
    if not guard.enabled:
        return
    off = off_index(actions)
    if off is None:
        return
    if all(mask is None or mask[off] for mask in allowed):
        guard_rows(guard, columns, observations, index, actions, off)
        return
    rows = index.shape[1]
    for i, mask in enumerate(allowed):
        if mask is None or mask[off]:
            guard_rows(guard, columns, observations[i * rows:(i + 1) * rows], index[i],
                       actions, off)
