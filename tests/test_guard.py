"""The goodput guard (env/guard.py): which rows it overrules and which it leaves, that it
is off when turned off, that it travels in the policy file, that the simulator's policy
adapter and local mode apply it on the same steps, and that ``specctl-serve guard.*`` and
``SPECCTL_GUARD`` override the file's alike."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import env.guard as guard_module
from controller.decider import evaluate
from controller.policy_file import ExportedPolicy, PolicyFileError
from controller.reload import PolicyHolder
from controller.server import ControllerServer, ServeOptions
from controller.wire import Decision, encode_step
from env.features import FeatureBuilder, FeatureSpec
from env.guard import (
    DEFAULT_GUARD,
    GuardSpec,
    apply_guard,
    guard_columns,
    guard_rows,
    off_index,
)
from env.probe import NO_PROBE
from env.rollout import DecisionLoop
from env.sim.acceptance import SGLangSimulatedAcceptance
from env.sim.cost_model import load_profile
from env.sim.simulator import SchedulerConfig, Simulator
from env.traces.schema import StepRecord
from env.traces.workloads import ClosedLoop
from sglang_hooks.local import LocalDecisions
from tests.lockstep import lockstep, with_meta

BACKENDS = ("numpy", "compiled")
OFF_GUARD = GuardSpec(enabled=False)


def depth1_policy(guard: GuardSpec = DEFAULT_GUARD) -> ExportedPolicy:
    """A policy that always chooses depth 1 (no probe: only the guard changes it)."""
    policy = ExportedPolicy.random(seed=2, hidden=(8,), name="d1")
    policy.biases[-1][1] = 1e3
    return dataclasses.replace(policy, probe=NO_PROBE, guard=guard)


def vector(spec: FeatureSpec, goodput: float, confidence_d: float, confidence_0: float,
           depth: int = 1, profile_error: float = 0.0) -> np.ndarray:
    names = spec.names()
    v = np.zeros(spec.size, dtype=np.float32)
    v[names.index(f"relative_goodput_{depth}")] = np.log(goodput) / 3.0
    v[names.index(f"cost_confidence_{depth}")] = confidence_d
    v[names.index("cost_confidence_0")] = confidence_0
    v[names.index("cost_profile_error")] = profile_error
    return v


def test_guard_rows_overrule_only_confident_losing_speculation():
    spec = FeatureSpec()
    actions = np.arange(spec.max_depth + 1)
    rows = np.stack([
        vector(spec, 0.5, 1.0, 1.0),  # priced at half of off, both costs measured: off
        vector(spec, 0.95, 1.0, 1.0),  # within the margin: kept
        vector(spec, 0.5, 0.1, 1.0),  # depth 1's cost a guess: kept
        vector(spec, 0.5, 1.0, 0.1),  # off's cost a guess: kept
        vector(spec, 0.5, 1.0, 1.0, profile_error=0.9),  # the profile far off: kept
        vector(spec, 0.5, 1.0, 1.0, depth=3),  # depth 3 priced low, row chose 3: off
        vector(spec, 0.5, 1.0, 1.0),  # chose off already
    ])
    index = np.array([[1, 1, 1, 1, 1, 3, 0]])
    guard_rows(DEFAULT_GUARD, guard_columns(spec), rows, index, actions, 0)
    assert index.tolist() == [[0, 1, 1, 1, 1, 0, 0]]
    index = np.array([[1, 1, 1, 1, 1, 3, 0]])
    guard_rows(OFF_GUARD, guard_columns(spec), rows, index, actions, 0)
    assert index.tolist() == [[1, 1, 1, 1, 1, 3, 0]]


def hopeless_row(spec: FeatureSpec, depth: int, ratio: float, profile: bool = True,
                 profile_error: float = 0.0) -> np.ndarray:
    """An observation row pricing ``depth`` at ``ratio`` times off, its cost unmeasured
    (confidence 0) and its goodput far below off's: only the hopeless rule may act."""
    v = vector(spec, 0.1, 0.0, 0.0, depth=depth, profile_error=profile_error)
    names = spec.names()
    v[names.index(f"relative_latency_{depth}")] = min(math.log(ratio), 3.0) / 3.0
    v[names.index("has_cost_profile")] = 1.0 if profile else 0.0
    return v


@pytest.mark.parametrize("streams", [1, 4])
def test_the_hopeless_rule_overrules_what_no_acceptance_could_pay(streams):
    """A depth priced above hopeless x (1 + d) times off runs off whatever the confidence,
    with a profile near the measurements; not below, not without a profile, not with a
    profile far off, not with the rule at 0, and not where the stream may not run off.
    The compiled many-row guard (several rows) and the one-row path agree."""
    spec = FeatureSpec()
    actions = np.arange(spec.max_depth + 1)
    rows = [hopeless_row(spec, 6, 8.8),  # 8.8 > 7 tokens: off
            hopeless_row(spec, 6, 6.5),  # could pay at full acceptance: kept
            hopeless_row(spec, 1, 2.5),  # 2.5 > 2: off
            hopeless_row(spec, 1, 2.5, profile=False),  # a prior's price: kept
            hopeless_row(spec, 1, 2.5, profile_error=0.9),  # profile far off: kept
            hopeless_row(spec, 7, 30.0)]  # capped at e^3 = 20 > 8: off
    chosen = [6, 6, 1, 1, 1, 7]
    expected = [0, 6, 0, 1, 1, 0]
    observations = np.concatenate([np.stack(rows)] * streams)
    for guard, want in ((GuardSpec(hopeless=1.0), expected), (DEFAULT_GUARD, chosen),
                        (GuardSpec(hopeless=2.0), [6, 6, 1, 1, 1, 0])):
        index = np.array([chosen] * streams, dtype=np.intp)
        apply_guard(guard, guard_columns(spec), observations, index, actions,
                    [None] * streams)
        assert index.tolist() == [want] * streams, guard
        for row, (obs, choice) in enumerate(zip(rows, chosen, strict=True)):
            one = np.array([[choice]], dtype=np.intp)
            apply_guard(guard, guard_columns(spec), obs[None, :], one, actions, [None])
            assert one[0, 0] == want[row], (guard, row)
    # a stream whose server cannot run off keeps its choice
    index = np.array([chosen] * 2, dtype=np.intp)
    no_off = np.ones(actions.size, dtype=bool)
    no_off[0] = False
    apply_guard(GuardSpec(hopeless=1.0), guard_columns(spec),
                np.concatenate([np.stack(rows)] * 2), index, actions, [no_off, None])
    assert index.tolist() == [chosen, expected]


def test_a_negative_margin_sends_ties_off():
    """The shipped policy's margin, -0.02: a depth must be priced at least 2% above off's
    goodput to run (a tie serves the same tokens for more GPU work); the conditions on
    measured costs and the profile hold as before."""
    spec = FeatureSpec()
    actions = np.arange(spec.max_depth + 1)
    rows = np.stack([
        vector(spec, 1.01, 1.0, 1.0),  # 1% above off: a tie, off
        vector(spec, 1.03, 1.0, 1.0),  # 3% above: kept
        vector(spec, 1.01, 0.1, 1.0),  # a tie, depth 1's cost a guess: kept
        vector(spec, 1.01, 1.0, 1.0, profile_error=0.9),  # the profile far off: kept
    ])
    for guard, want in ((GuardSpec(margin=-0.02), [0, 1, 1, 1]), (DEFAULT_GUARD, [1, 1, 1, 1])):
        index = np.array([[1, 1, 1, 1]])
        guard_rows(guard, guard_columns(spec), rows, index, actions, 0)
        assert index.tolist() == [want], guard
        one = np.array([[1]])  # the one-row path (the simulator's adapter) alike
        guard_rows(guard, guard_columns(spec), rows[:1], one, actions, 0)
        assert one.tolist() == [[want[0]]]


def reference_guard_rows(guard: GuardSpec, columns, observations: np.ndarray,
                         index: np.ndarray, actions: np.ndarray, off: int | None) -> None:
    """The guard as first written (whole-array numpy over every row choosing d > 0): what
    the one-row and goodput-first paths must decide exactly alike."""
    if not guard.enabled or off is None:
        return
    steps = actions[index.ravel()]
    rows = np.flatnonzero(steps > 0)
    if not rows.size:
        return
    chosen = steps[rows]
    obs = observations[rows]
    goodput = obs[np.arange(rows.size), columns.goodput[chosen]] * 3.0
    sure = np.minimum(obs[np.arange(rows.size), columns.confidence[chosen]],
                      obs[:, columns.confidence[0]])
    trusted = np.abs(obs[:, columns.profile_error]) <= guard.max_profile_error
    overruled = rows[(goodput < math.log1p(-guard.margin)) & (sure >= guard.confidence)
                     & trusted]
    index.flat[overruled] = off


@contextlib.contextmanager
def guard_path(compiled: bool):
    """apply_guard's many-row path compiled (where numba is installed) or numpy's."""
    saved = guard_module._KERNEL
    guard_module._KERNEL = ... if compiled else None
    try:
        yield
    finally:
        guard_module._KERNEL = saved


@pytest.mark.parametrize("compiled", [True, False])
def test_a_goodput_exactly_at_the_threshold_is_kept(compiled):
    """``relative_goodput_d * 3`` equal to ``log1p(-margin)`` (in float32, as numpy compares)
    is not below it: kept; the largest float32 whose product is below is overruled (both
    paths; values the hypothesis test above does not hit exactly)."""
    spec = FeatureSpec()
    columns = guard_columns(spec)
    at = np.float32(-0.1)
    guard = GuardSpec(margin=-math.expm1(float(at * np.float32(3.0))))
    assert np.float32(math.log1p(-guard.margin)) == at * np.float32(3.0)
    rows = np.zeros((2, spec.size), dtype=np.float32)
    rows[:, columns.confidence] = 1.0
    rows[0, columns.goodput[1]] = at
    below = at  # the largest float32 whose product by 3 is below
    while below * np.float32(3.0) == at * np.float32(3.0):
        below = np.nextafter(below, np.float32(-1.0))
    rows[1, columns.goodput[1]] = below
    index = np.ones((1, 2), dtype=np.int64)
    with guard_path(compiled):
        apply_guard(guard, columns, rows, index, np.arange(spec.max_depth + 1), [None])
    assert index.tolist() == [[1, 0]]


def _near(dtype, *centres: float):
    """Values at, next to and around the guard's thresholds (in ``dtype``), and the odd
    ones: NaN, infinities, zero."""
    edges = []
    for centre in centres:
        value = dtype(centre)
        edges += [value, np.nextafter(value, dtype(np.inf)), np.nextafter(value, dtype(-np.inf))]
    return (st.sampled_from(edges) | st.sampled_from([np.nan, np.inf, -np.inf, 0.0, -0.0])
            | st.floats(-1.5, 1.5, width=32))


@settings(max_examples=300)
@given(data=st.data(), streams=st.integers(1, 3), rows=st.integers(1, 20),
       dtype=st.sampled_from([np.float32, np.float64]),
       margin=st.sampled_from([0.1, 0.05, 0.3, 0.0, -0.02]), confidence=st.sampled_from([0.5, 0.2]),
       max_error=st.sampled_from([0.5, 0.0, 1.0]), enabled=st.booleans(),
       with_off=st.integers(0, 3))
def test_the_guard_decides_as_the_whole_array_code_did(data, streams, rows, dtype, margin,
                                                       confidence, max_error, enabled,
                                                       with_off):
    """Random observations (the four columns the guard reads at, beside and around its
    thresholds, NaN and infinities too), actions with and without off, servers that may not
    run off: apply_guard, its one-row path included, changes the entries the first
    vectorised code did, and no other."""
    spec = FeatureSpec()
    columns = guard_columns(spec)
    guard = GuardSpec(enabled=enabled, margin=margin, confidence=confidence,
                      max_profile_error=max_error)
    depths = list(range(spec.max_depth + 1))
    actions = np.array(data.draw(st.permutations(depths)) if with_off else
                       data.draw(st.lists(st.sampled_from(depths[1:]), min_size=1, max_size=8)))
    observations = np.zeros((streams * rows, spec.size), dtype=dtype)
    threshold = math.log1p(-margin) / 3.0
    for row in observations:
        for column in columns.goodput[1:]:
            row[column] = data.draw(_near(dtype, threshold))
        for column in columns.confidence:
            row[column] = data.draw(_near(dtype, confidence))
        row[columns.profile_error] = data.draw(_near(dtype, max_error, -max_error))
    index = np.array(data.draw(st.lists(st.integers(0, len(actions) - 1),
                                        min_size=streams * rows, max_size=streams * rows)))
    index = index.reshape(streams, rows)
    off = off_index(actions)
    allowed = [None if mask is None else np.array(mask) for mask in data.draw(st.lists(
        st.none() | st.lists(st.booleans(), min_size=len(actions), max_size=len(actions)),
        min_size=streams, max_size=streams))]
    expected = index.copy()
    for i, mask in enumerate(allowed):
        if mask is None or off is None or mask[off]:
            reference_guard_rows(guard, columns, observations[i * rows:(i + 1) * rows],
                                 expected[i], actions, off)
    for compiled in (True, False):  # env.guard_compiled's kernel, and numpy's path
        got = index.copy()
        with guard_path(compiled):
            apply_guard(guard, columns, observations, got, actions, allowed)
        assert got.tolist() == expected.tolist(), compiled
    index = got
    one = index[:1, :1].copy()  # one row on its own: the simulator adapter's call
    expected_one = one.copy()
    reference_guard_rows(guard, columns, observations[:1], expected_one, actions, off)
    guard_rows(guard, columns, observations[:1], one, actions, off)
    assert one.tolist() == expected_one.tolist()
    assert off == (int(np.flatnonzero(actions == 0)[0]) if (actions == 0).any() else None)


def test_guards_alternating_on_the_same_arrays_each_decide_as_their_own():
    """apply_guard keeps the compiled guard's settings of its latest call by identity:
    calls alternating two guards (margins on either side of the rows' goodput) on the
    same actions and observations, then actions without off, then the observations in
    float64, must each overrule what that guard alone does (a cache that left the guard
    or the actions out of its key hands a call the previous one's limits or off index;
    the dtype's part is only exercised: its limits differ in the last bits)."""
    spec = FeatureSpec()
    columns = guard_columns(spec)
    keen, lax = GuardSpec(margin=0.0), GuardSpec(margin=0.3)  # 0.9 loses under keen only
    rows = np.stack([vector(spec, 0.9, 0.9, 0.9)] * 4)
    actions = np.arange(spec.max_depth + 1)
    no_off = actions[:0:-1].copy()  # 7 ... 1: a stale off index (0) would show
    wide = rows.astype(np.float64)
    for guard, observations, acts in [(keen, rows, actions), (lax, rows, actions),
                                      (keen, rows, actions), (keen, rows, no_off),
                                      (keen, wide, actions), (lax, wide, actions),
                                      (keen, rows, actions)]:
        for compiled in (True, False):
            index = np.full((2, 2), int(np.flatnonzero(acts == 1)[0]), dtype=np.intp)
            expected = index.copy()
            off = off_index(acts)
            for i in range(2):
                reference_guard_rows(guard, columns, observations[2 * i:2 * i + 2],
                                     expected[i], acts, off)
            with guard_path(compiled):
                apply_guard(guard, columns, observations, index, acts, [None, None])
            assert index.tolist() == expected.tolist(), (guard.margin, acts.size, compiled)
    # the case above is not vacuous: keen overrules these rows, lax does not
    index = np.full((2, 2), 1, dtype=np.intp)
    apply_guard(keen, columns, rows, index, actions, [None, None])
    assert (index == off_index(actions)).all()
    index = np.full((2, 2), 1, dtype=np.intp)
    apply_guard(lax, columns, rows, index, actions, [None, None])
    assert (index == 1).all()


def _profiled_stream(profile, scale: float = 1.0, n: int = 40) -> list[StepRecord]:
    """Alternating off and depth-1 records at batch 48, at ``scale`` times the profile's
    latency, where depth 1's draft is never accepted."""
    out = []
    for i in range(n):
        steps = i % 2
        latency = scale * profile.step_latency_s(48, steps, 50_000, 0, draft_extend=bool(steps),
                                                 speculative_path=bool(steps))
        drafts = np.zeros(48 if steps else 0, dtype=np.int8)
        out.append(StepRecord("srv", 0, i, i * 0.01, 48, 0, 48, 50_000, 500_000, 0, steps,
                              drafts, latency))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_measured_losing_depth_is_turned_off(backend):
    profile = load_profile("h200_llama31_8b")
    builder = FeatureBuilder(None, profile, backend)
    builder.update_many(_profiled_stream(profile))
    grid = [builder.observation_grid()]
    row = list(builder.spec.batch_grid).index(48)
    guarded, _, _ = evaluate(depth1_policy(), grid, [None])
    plain, _, _ = evaluate(depth1_policy(OFF_GUARD), grid, [None])
    assert plain[0, row] == 1 and guarded[0, row] == 0
    # a server that cannot run off keeps the policy's choice
    no_off = np.array([False] + [True] * builder.spec.max_depth)
    kept, _, _ = evaluate(depth1_policy(), grid, [no_off])
    assert kept[0, row] == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_profile_far_off_leaves_the_policy_alone(backend):
    profile = load_profile("h200_llama31_8b")
    builder = FeatureBuilder(None, profile, backend)
    builder.update_many(_profiled_stream(profile, scale=3.0))  # log(3) = 1.1 off the profile
    row = list(builder.spec.batch_grid).index(48)
    chosen, _, _ = evaluate(depth1_policy(), [builder.observation_grid()], [None])
    assert chosen[0, row] == 1


def test_guard_settings_are_checked_and_travel_in_the_policy_file(tmp_path):
    for margin in (-0.5, 1.0, True):
        with pytest.raises(ValueError, match=r"guard\.margin"):
            GuardSpec(margin=margin)
    with pytest.raises(ValueError, match=r"guard\.max_profile_error"):
        GuardSpec(max_profile_error=2.0)
    with pytest.raises(ValueError, match=r"guard: unknown fields"):
        DEFAULT_GUARD.override({"depth": 1})
    for hopeless in (0.5, 20.0, True):
        with pytest.raises(ValueError, match=r"guard\.hopeless"):
            GuardSpec(hopeless=hopeless)
    assert "hopeless" not in DEFAULT_GUARD.to_dict()  # older files keep their bytes
    assert GuardSpec.from_dict(GuardSpec(hopeless=1.0).to_dict()).hopeless == 1.0
    path = tmp_path / "policy.npz"
    changed = GuardSpec(margin=0.2, max_profile_error=0.3)
    depth1_policy(changed).save(path)
    assert ExportedPolicy.load(path).guard == changed
    # a file without a guard (written before the guard existed) gets the default
    kept = Path(__file__).resolve().parents[1] / "docs/results/h200/policy_778dd34c.npz"
    assert ExportedPolicy.load(kept).guard == DEFAULT_GUARD
    with pytest.raises(PolicyFileError, match="field 'guard'"):
        ExportedPolicy.loads(with_meta(path, guard={"margin": 5}), "bad.npz")


def test_specctl_eval_evaluates_a_copy_with_the_guard_changed(tmp_path):
    from omegaconf import OmegaConf

    from agents.evaluate import _with_rule_changes

    path = tmp_path / "policy.npz"
    ExportedPolicy.random(seed=1).save(path)
    unchanged = OmegaConf.create({"enabled": None})
    assert _with_rule_changes(str(path), None, tmp_path / "out", unchanged) == str(path)
    copy = _with_rule_changes(str(path), None, tmp_path / "out",
                              OmegaConf.create({"enabled": False}))
    assert ExportedPolicy.load(copy).guard == OFF_GUARD
    with pytest.raises(ValueError, match=r"specctl-eval guard\.margin"):
        _with_rule_changes(str(path), None, tmp_path / "out", OmegaConf.create({"margin": 2.0}))


def test_the_simulator_and_local_mode_guard_the_same_steps():
    """The env path (DecisionLoop + ExportedPolicyAdapter) and a StreamDecider fed the same
    released records decide the same steps where the guard overrules depth 1 (a draft
    that is never accepted)."""
    profile = load_profile("h200_llama31_8b")
    policy = depth1_policy()
    sim = Simulator(profile, SGLangSimulatedAcceptance(1.0), ClosedLoop(48, 256, 256),
                    SchedulerConfig(max_running_requests=48), seed=3)
    loop = DecisionLoop(sim, None, feedback_lag=3, horizon_s=3.0, cost_prior=profile)
    # The first steps run off whatever the policy says: off's cost gets measured (the
    # guard acts only where both costs are), as it would after any off period.
    choices = lockstep(loop, policy, profile,
                       run=lambda compared, choice: choice if compared > 20 else 0)
    assert len(choices) > 100 and sum(c == 0 for c in choices) > len(choices) // 2


def _served(path, options_guard: dict | None, local_guard: bool | None,
            reload_to: ExportedPolicy | None = None) -> list[Decision]:
    """The decisions ``specctl-serve`` (``ServeOptions.guard``, as ``guard.*`` on its
    command line sets it) and local mode (``LocalDecisions``' ``guard``, as
    ``SPECCTL_GUARD`` sets it) make on :func:`_profiled_stream`'s telemetry, asserted
    equal record for record. ``reload_to``: the daemon reloads its file, now this
    policy, before the first record."""
    profile = load_profile("h200_llama31_8b")
    server = ControllerServer(PolicyHolder(path), ServeOptions(endpoint="inproc://guard",
                                                               guard=options_guard),
                              cost_prior=profile)
    local = LocalDecisions(str(path), tuple(range(FeatureSpec().max_depth + 1)),
                           "h200_llama31_8b", guard=local_guard)
    decisions = []
    try:
        if reload_to is not None:
            reload_to.save(path)
            server.holder.request_reload()
            assert server.holder.poll() is True
            local.holder.request_reload()
        for record in _profiled_stream(profile):
            frame = encode_step(record)
            pending: dict = {}
            server.handle_frame((b"peer", ""), frame, pending)
            (_, remote), = server.decide(pending)
            assert local.decide(frame) == remote, f"step {record.step_index}"
            decisions.append(remote)
    finally:
        server.close()
    return decisions


def test_serving_and_local_mode_override_the_files_guard_alike(tmp_path):
    """``specctl-serve guard.enabled=false`` and ``SPECCTL_GUARD=0``: the daemon and local
    mode make the policy's own decisions (depth 1 on every row) where the file's guard
    turns the measured losing depth 1 off; ``guard.enabled=true`` / ``SPECCTL_GUARD=1``
    over a file whose guard is off give the guarded decisions."""
    on_path, off_path = tmp_path / "on.npz", tmp_path / "off.npz"
    depth1_policy().save(on_path)
    depth1_policy(OFF_GUARD).save(off_path)
    guarded = _served(on_path, None, None)
    assert any(0 in d.steps for d in guarded)  # the guard acts on this stream
    unguarded = _served(on_path, {"enabled": False}, False)
    assert all(d.steps == (1,) for d in unguarded)
    assert _served(off_path, None, None) == unguarded  # the file's own setting
    assert _served(off_path, {"enabled": True}, True) == guarded


def test_the_daemons_guard_override_outlives_a_reload(tmp_path):
    """A reloaded policy file (its guard on, another margin) is served with the command
    line's ``guard.enabled=false`` still applied."""
    path = tmp_path / "policy.npz"
    depth1_policy().save(path)
    reloaded = dataclasses.replace(depth1_policy(GuardSpec(margin=0.2)), name="reloaded")
    decisions = _served(path, {"enabled": False}, False, reload_to=reloaded)
    assert all(d.policy == "reloaded" and d.steps == (1,) for d in decisions)
