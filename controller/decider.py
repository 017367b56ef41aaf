"""Observations in, speculation steps out: the decision both deciders make.

``specctl-serve`` (:mod:`controller.server`) decides for many streams per poll
and the plugin's local mode (:class:`StreamDecider`, on the plugin's I/O
thread) for its one stream; both fold telemetry into the policy file's
:class:`env.features.FeatureBuilder` and call :func:`choose`, so a given
telemetry stream gets the same decisions either way
(``tests/test_local_decisions.py``). Both apply the goodput guard (:mod:`env.guard`)
and the acceptance probe (:mod:`env.probe`) the same way, from the same features, each
as the policy file sets it with the same overrides (:func:`served_rules`).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence

import numpy as np

from controller import fast_tanh
from controller.fast_tanh import decide_rows
from controller.policy_file import ExportedPolicy
from controller.wire import DECISION_LAG, Decision
from env.features import FeatureBuilder, warm_up
from env.guard import GuardSpec, apply_guard
from env.guard import warm_up as warm_up_guard
from env.probe import ProbeSpec, apply_probe
from env.traces.schema import StepRecord

#: Streams a batched evaluation needs for the approximate tanh (controller.fast_tanh).
_APPROXIMATE_FROM = 3

#: The decision-layer rules a policy file carries that serving may override (the
#: ``probe`` and ``guard`` blocks of ``specctl-serve``, ``SPECCTL_PROBE`` / ``SPECCTL_GUARD``).
RULES = ("probe", "guard")


def served_rule(policy: ExportedPolicy, name: str, changes: Mapping | None
                ) -> ProbeSpec | GuardSpec:
    """The policy file's rule ``name`` (one of :data:`RULES`) with ``changes`` (its
    fields by name, None entries ignored) applied; raises ValueError naming the field."""
    return getattr(policy, name).override(changes)


def served_rules(policy: ExportedPolicy, overrides: Mapping[str, Mapping | None]
                 ) -> tuple[ProbeSpec, GuardSpec]:
    """``(probe, guard)`` as served: the policy file's, with ``overrides`` (by rule name,
    see :func:`served_rule`) applied."""
    probe, guard = (served_rule(policy, name, overrides.get(name)) for name in RULES)
    return probe, guard


def allowed_actions(actions: np.ndarray, candidates: Sequence[int] | None) -> np.ndarray | None:
    """Which of the policy's actions a server offering ``candidates`` can run (None: all)."""
    if candidates is None:
        return None
    mask = np.isin(actions, np.asarray(candidates, dtype=np.int64))
    return None if mask.all() else mask  # None: no masking on every decision


def probing_flags(probe: ProbeSpec, builders: Sequence[FeatureBuilder | None]
                  ) -> list[int] | None:
    """Per stream which probe its decision now runs (its features' probe budgets, see
    :mod:`env.probe`: 0 none, 1 acceptance, 2 off, 3 cost; a builder None: 0); None when the
    probe is off (nothing to do)."""
    if not probe.enabled:
        return None
    return [0 if b is None else b.probing for b in builders]


def choose(policy: ExportedPolicy, actions: np.ndarray,
           grids: np.ndarray | Sequence[np.ndarray | None],
           allowed: Sequence[np.ndarray | None], probing: Sequence[int] | None = None,
           probe: ProbeSpec | None = None, guard: GuardSpec | None = None
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One batched policy evaluation over several streams' observation grids.

    Args:
        policy: The policy.
        actions: ``policy.actions`` as an array.
        grids: The streams' grids stacked, shape (streams, grid rows, size) (see
            :func:`env.features.observation_grids`), or per stream its
            ``observation_grid()`` or None (its features failed).
        allowed: Per stream the mask of :func:`allowed_actions`, or None (all).
        probing: Per stream whether its decision probes (:func:`probing_flags`), or
            None (none does).
        probe: The probe's settings (None: the policy's).
        guard: The goodput guard's settings (None: the policy's).

    Returns:
        ``(steps, healthy, runnable)``: the chosen steps, shape (streams, grid rows);
        whether the stream's observations were finite and present (a stream that is not
        gets a fallback, and should start afresh); whether any action was allowed.
    """
    index, healthy, runnable = evaluate(policy, grids, allowed, probing, probe, guard)
    return actions[index], np.asarray(healthy), np.asarray(runnable)


def evaluate(policy: ExportedPolicy, grids: np.ndarray | Sequence[np.ndarray | None],
             allowed: Sequence[np.ndarray | None], probing: Sequence[int] | None = None,
             probe: ProbeSpec | None = None, guard: GuardSpec | None = None
             ) -> tuple[np.ndarray, list[bool], list[bool]]:
    """:func:`choose` with the chosen actions as their index into ``policy.actions``
    (shape (streams, grid rows), dtype intp: the daemon keys its wire forms on their
    bytes) and the flags as lists: what the daemon reads per poll.
    ``guard``: the goodput guard (:mod:`env.guard`; None: the policy file's).
    """
    # Few, whole-array numpy calls: at these sizes each call's ~1 us overhead is the cost.
    rows = len(policy.feature_spec.batch_grid)
    n = len(grids)
    failed = None
    if isinstance(grids, np.ndarray):
        observations = grids.reshape(n * rows, -1)
    else:
        failed = [g is None for g in grids]
        if any(failed):
            blank = np.zeros((rows, policy.feature_spec.size), dtype=np.float32)
            grids = [blank if g is None else g for g in grids]
        else:
            failed = None
        observations = grids[0] if n == 1 else np.concatenate(grids)
    if fast_tanh.all_finite(observations):
        healthy = [True] * n
    else:  # estimator overflow: that stream only
        healthy = np.isfinite(observations).reshape(n, -1).all(axis=1).tolist()
        observations = np.nan_to_num(observations, nan=0.0, posinf=1.0, neginf=-1.0)
    if failed is not None:
        healthy = [ok and not bad for ok, bad in zip(healthy, failed, strict=True)]
    # The hidden layers' tanh approximated (controller.fast_tanh), where it applies: each
    # stream with a row whose best two logits come within the policy's tolerance is
    # decided again below on the exact forward, so every decision is the exact one's.
    # Not below three streams (local mode, a daemon's small polls): three compiled calls'
    # dispatch cost as much as the tanh saves on one or two grids (lock-step A/B: one
    # +2.5-4%, two +1.5%, three -2%, eight -5%, 64 -10%).
    logits = policy.approximate_logits(observations) if n >= _APPROXIMATE_FROM else None
    approximate = logits is not None
    if not approximate:
        logits = policy.logits(observations)
    if all(a is None for a in allowed):
        runnable = [True] * n
        penalty = None
    else:
        count = len(policy.actions)
        masks = np.stack([np.ones(count, dtype=bool) if a is None else a for a in allowed])
        runnable = masks.any(axis=1).tolist()
        # -inf where the server cannot run the action: never the arg-max
        penalty = np.where(masks, 0.0, -np.inf)
        logits = (logits.reshape(n, rows, -1) + penalty[:, None, :]).reshape(n * rows, -1)
    if approximate:
        # each row's arg-max with the unsure marks, in one compiled pass (a stream not
        # marked has a unique finite best in every row: numpy's arg-max; a marked one is
        # decided again below)
        index, unsure = decide_rows(logits, rows, policy.tanh_tolerance)
        if unsure.any():
            for i in unsure.nonzero()[0].tolist():
                # the stream's own grid, exact: local mode's forward, row for row
                exact = policy.logits(observations[i * rows:(i + 1) * rows])
                if penalty is not None:
                    exact = exact + penalty[i]
                index[i] = exact.argmax(axis=1)
    else:  # the method, not np.argmax: the same call without numpy's Python-level wrapper
        index = logits.argmax(axis=1).reshape(n, rows)
    # The goodput guard, then the probe (which may turn a guarded row into a probe): the
    # order the simulator's policy adapter applies them in.
    actions = policy.action_array
    apply_guard(policy.guard if guard is None else guard, policy.guard_columns,
                observations, index, actions, allowed)
    if probing is not None and any(probing):
        apply_probe(probe or policy.probe, index, actions, probing, allowed, observations,
                    policy.guard_columns.latency)
    return index, healthy, runnable


def compress(grid: Sequence[int], steps: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Drop grid entries that repeat the previous entry's steps (same meaning, fewer bytes)."""
    out_grid, out_steps = [grid[0]], [steps[0]]
    for size, step in zip(grid[1:], steps[1:], strict=True):
        if step != out_steps[-1]:
            out_grid.append(size)
            out_steps.append(step)
    return tuple(out_grid), tuple(out_steps)


def steps_at(grid: Sequence[int], steps: Sequence[int], batch_size: int) -> int:
    """The steps a decision over ``grid`` gives a batch of ``batch_size``."""
    return steps[max(bisect.bisect_right(grid, batch_size) - 1, 0)]


class StreamDecider:
    """One stream's decisions, as the daemon makes them (the plugin's local mode).

    Args:
        policy: The policy (replace it with :meth:`set_policy`).
        candidates: The steps the server offers (its HELLO's ``candidate_steps``).
        cost_prior: The server's cost profile (the features' latency prior), or None.
        probe: Overrides of the policy file's acceptance probe (a mapping of
            :class:`env.probe.ProbeSpec` fields, None entries ignored), or None.
        guard: Overrides of the policy file's goodput guard (of
            :class:`env.guard.GuardSpec` fields, likewise), or None.
    """

    def __init__(self, policy: ExportedPolicy, candidates: Sequence[int] | None,
                 cost_prior=None, probe: dict | None = None,
                 guard: dict | None = None) -> None:
        self.cost_prior = cost_prior
        #: Applied over every policy served (the file's, a reloaded or a pushed one).
        self.overrides = {"probe": probe, "guard": guard}
        self.candidates = None if candidates is None else tuple(candidates)
        self.seq = 0
        self.last_step = -1
        self.resets = 0
        #: The batch of the latest decode record folded (as the daemon's stream keeps it):
        #: a prefill record's decision is counted at it.
        self.batch_size = 1
        self.set_policy(policy)

    def set_policy(self, policy: ExportedPolicy) -> None:
        """Serve ``policy`` from now on (features start afresh if its spec differs)."""
        old = getattr(self, "policy", None)
        self.policy = policy
        self.actions = np.asarray(policy.actions)
        self.allowed = allowed_actions(self.actions, self.candidates)
        probe, self.guard = served_rules(policy, self.overrides)
        if old is None or old.feature_spec != policy.feature_spec:
            # The compiled features load (or compile) here, not at the first decision.
            warm_up(policy.feature_spec, self.cost_prior)
            fast_tanh.warm_up()
            warm_up_guard(policy.feature_spec)
            self.builder = FeatureBuilder(policy.feature_spec, self.cost_prior, probe=probe)
        elif probe != self.probe:
            self.builder.set_probe(probe)
        self.probe = probe

    def restart(self) -> None:
        """Start the stream afresh (its features reset) after its observation was not
        finite or a decision failed, as the daemon resets such a stream."""
        self.builder.reset()
        self.resets += 1

    def decide(self, record: StepRecord) -> Decision:
        """Fold ``record`` (a decoded TELEMETRY) and answer it, as the daemon would."""
        if record.step_index <= self.last_step:
            self.builder.reset()  # the server restarted: a new run
        self.last_step = record.step_index
        self.seq += 1
        apply_from = record.step_index + DECISION_LAG
        policy = self.policy
        if record.prefill_tokens == 0:
            self.batch_size = record.batch_size
        try:
            self.builder.update(record)
            grids = [self.builder.observation_grid()]
        except Exception:  # e.g. LinAlgError: this stream starts afresh, as in the daemon
            grids = [None]
        probing = None if grids[0] is None else probing_flags(self.probe, [self.builder])
        steps, healthy, runnable = choose(policy, self.actions, grids, [self.allowed], probing,
                                          self.probe, self.guard)
        if not healthy[0]:
            self.restart()
            return Decision.fallback(self.seq, apply_from, policy.name)
        if not runnable[0]:
            return Decision.fallback(self.seq, apply_from, policy.name)
        grid, chosen = policy.feature_spec.batch_grid, steps[0].tolist()
        unheld = self.builder.unheld
        if unheld:  # the start rule counts what its decisions run (at the latest decode
            # record's batch, as the daemon)
            unheld = self.builder.decided(steps_at(grid, chosen, self.batch_size))
        return Decision(self.seq, apply_from, policy.name, *compress(grid, chosen), unheld)
