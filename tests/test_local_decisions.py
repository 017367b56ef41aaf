"""Local decision mode: the plugin's in-process decisions equal the daemon's, record for
record, on many random telemetry streams; the client answers locally without a
controller; and specctl-serve, as the fleet hub, pushes its policy to such plugins."""

from __future__ import annotations

import shutil
import threading
import time
from dataclasses import replace

import msgpack
import numpy as np
import pytest

from controller.decider import StreamDecider, allowed_actions, choose
from controller.default_policy import default_policy_path
from controller.policy_file import ExportedPolicy, PolicyFileError
from controller.reload import PolicyHolder
from controller.server import ControllerServer, ServeOptions
from controller.wire import (
    DECISION_LAG,
    MAX_POLICY_BYTES,
    Hello,
    PolicyPush,
    WireError,
    decode,
    encode_hello,
    encode_policy,
    pack_telemetry,
)
from env import features_compiled
from env.features import FeatureBuilder
from env.sim.cost_model import load_profile
from sglang_hooks.client import ControllerClient
from sglang_hooks.local import LocalDecisions
from sglang_hooks.marker import CONTROLLER
from sglang_hooks.testing import ManualClock, io_round, socket_dir, wait_until

CANDIDATES = (0, 1, 2, 3, 5)  # a server offering fewer depths than the policy's actions


def telemetry_stream(seed: int, length: int, restart: bool = True) -> list[bytes]:
    """Random but plausible telemetry: load drifts, depth changes, prefills, a restart."""
    rng = np.random.default_rng(seed)
    frames, step, batch = [], 0, int(rng.integers(1, 300))
    restart = int(rng.integers(5, length)) if restart else -1
    for i in range(length):
        step = 1 if i == restart else step + int(rng.integers(1, 3))
        batch = int(np.clip(batch + rng.integers(-8, 9), 1, 1024))
        prefill = int(rng.integers(1, 4096)) if rng.random() < 0.1 else 0
        steps = 0 if prefill else int(rng.choice(CANDIDATES))
        accepted = (rng.integers(0, steps + 1, size=batch).astype(np.int8).tobytes()
                    if steps else b"")
        capacity = 500_000
        latency = 0.0 if rng.random() < 0.05 else float(rng.uniform(0.004, 0.08))
        frames.append(pack_telemetry(
            "srv", 0, step, i * 0.02, batch, int(rng.integers(0, 500)), batch,
            int(rng.integers(0, capacity)), capacity, prefill, steps, accepted,
            sum(accepted), latency))
    return frames


@pytest.mark.parametrize("profile", [None, "h200_llama31_8b"])
@pytest.mark.parametrize("shipped", [False, True])
def test_local_decisions_equal_the_daemons(tmp_path, profile, shipped):
    """A random policy, and the shipped file with its probes and guard (without a profile
    its start rule marks decisions unheld, and a prefill's answer counts at the last
    decode batch: local mode once raised there)."""
    path = tmp_path / "policy.npz"
    if shipped:
        shutil.copy(default_policy_path(), path)
    else:
        ExportedPolicy.random(seed=3, hidden=(32,)).save(path)
    cost_prior = load_profile(profile) if profile else None
    server = ControllerServer(PolicyHolder(path), ServeOptions(endpoint="inproc://parity"),
                              cost_prior=cost_prior)
    compared = 0
    try:
        for seed in range(12):
            peer = (f"peer-{seed}".encode(), "")
            pending: dict = {}
            server.handle_frame(peer, encode_hello(Hello("srv", 0, CANDIDATES)), pending)
            local = StreamDecider(ExportedPolicy.load(path), CANDIDATES, cost_prior)
            for frame in telemetry_stream(seed, 150):
                pending = {}
                server.handle_frame(peer, frame, pending)
                (_, remote), = server.decide(pending)
                mine = local.decide(decode(frame))
                assert mine == remote, f"seed {seed}, step {decode(frame).step_index}"
                compared += 1
    finally:
        server.close()
    assert compared == 12 * 150


def test_a_policy_of_more_than_256_actions_decides_as_local_mode(tmp_path):
    """The daemon keys a decision's wire form by its actions' indices as bytes: past 256
    actions (repeats allowed) an index takes two bytes, and must not wrap."""
    path = tmp_path / "policy.npz"
    actions = [i * 8 // 300 for i in range(300)]  # an index mod 256 is another action
    ExportedPolicy.random(actions=actions, hidden=(16,), seed=5).save(path)
    server = ControllerServer(PolicyHolder(path), ServeOptions(endpoint="inproc://wide"))
    chosen = set()
    try:
        peer = (b"peer", "")
        local = StreamDecider(ExportedPolicy.load(path), None)
        for frame in telemetry_stream(7, 120):
            pending: dict = {}
            server.handle_frame(peer, frame, pending)
            (_, remote), = server.decide(pending)
            assert remote == local.decide(decode(frame))
            chosen.update(remote.steps)
    finally:
        server.close()
    assert len(chosen) > 1  # not one constant answer


@pytest.mark.parametrize("answers", [1, 4])
def test_records_sharing_a_poll_get_local_modes_decisions(tmp_path, answers):
    """Several records of one stream in one poll (a daemon late by more than a step): the
    latest ``answers_per_poll`` of them are answered, in order, each with the decision
    local mode makes on that record; older ones are folded unanswered."""
    path = tmp_path / "policy.npz"
    ExportedPolicy.random(seed=4, hidden=(32,)).save(path)
    server = ControllerServer(PolicyHolder(path), ServeOptions(
        endpoint="inproc://polls", answers_per_poll=answers, max_records_per_poll=16))
    try:
        peer = (b"peer", "")
        server.handle_frame(peer, encode_hello(Hello("srv", 0, CANDIDATES)), {})
        local = StreamDecider(ExportedPolicy.load(path), CANDIDATES)
        frames = telemetry_stream(11, 60, restart=False)
        mine = [local.decide(decode(frame)) for frame in frames]
        position = 0
        for size in (1, 3, 7, 2, 10, 1, 6, 30):  # records per poll (16 at most are kept)
            pending: dict = {}
            polled = frames[position:position + size]
            for frame in polled:
                server.handle_frame(peer, frame, pending)
            remote = [decision for _, decision in server.decide(pending)]
            if size > 16:  # the daemon sheds beyond max_records_per_poll: features differ
                break
            expected = mine[position:position + size][-answers:]
            assert [d.apply_from_step for d in remote] == [
                d.apply_from_step for d in expected], f"poll of {size} at {position}"
            # seq counts each decider's own answers: everything else is equal
            assert [replace(d, seq=0) for d in remote] == [replace(d, seq=0) for d in expected]
            position += size
    finally:
        server.close()


@pytest.mark.parametrize("backend", ["numpy", "compiled"])
def test_a_non_finite_observation_mid_poll_starts_afresh_as_local_mode(tmp_path, monkeypatch,
                                                                        backend):
    """A record whose observation is not finite gets a fallback and its stream starts
    afresh; the stream's later records in the same poll are then folded into the fresh
    features, exactly as local mode folds them."""
    if backend == "compiled":
        pytest.importorskip("numba")
    monkeypatch.setenv("SPECCTL_FEATURES", backend)
    frames = telemetry_stream(11, 30, restart=False)
    poisoned = {decode(frames[k]).step_index for k in (12, 21)}
    builder_class = type(FeatureBuilder())
    fold = builder_class.update

    def update(self, record):  # an estimate turns NaN after these records
        fold(self, record)
        if record.step_index in poisoned:
            if self.backend == "numpy":
                self._prior_log_error = float("nan")
            else:
                self._state[features_compiled._PRIOR_LOG_ERROR] = float("nan")

    monkeypatch.setattr(builder_class, "update", update)
    path = tmp_path / "policy.npz"
    ExportedPolicy.random(seed=4, hidden=(32,)).save(path)
    server = ControllerServer(PolicyHolder(path), ServeOptions(
        endpoint="inproc://nonfinite", answers_per_poll=4, max_records_per_poll=16))
    try:
        peer = (b"peer", "")
        server.handle_frame(peer, encode_hello(Hello("srv", 0, CANDIDATES)), {})
        local = StreamDecider(ExportedPolicy.load(path), CANDIDATES)
        mine = [local.decide(decode(frame)) for frame in frames]
        assert local.resets == 2
        for frame in frames[:10]:  # the same history, a poll each
            pending = {}
            server.handle_frame(peer, frame, pending)
            server.decide(pending)
        remote = []
        for start in range(10, 30, 5):  # polls of 5 records; the poisoned are 3rd and 2nd
            pending: dict = {}
            for frame in frames[start:start + 5]:
                server.handle_frame(peer, frame, pending)
            remote.append([decision for _, decision in server.decide(pending)])
        expected = [mine[start:start + 5][-4:] for start in range(10, 30, 5)]
        assert [[replace(d, seq=0) for d in poll] for poll in remote] == [
            [replace(d, seq=0) for d in poll] for poll in expected]
        assert sum(d.is_fallback for poll in remote for d in poll) >= 2
        assert server.metrics.registry.get_sample_value(
            "specctl_stream_resets_total", {"reason": "nonfinite"}) == 2
    finally:
        server.close()


def test_the_client_decides_locally_without_a_controller(tmp_path):
    path = tmp_path / "policy.npz"
    ExportedPolicy.random(seed=1).save(path)
    local = LocalDecisions(str(path), CANDIDATES)
    clock = ManualClock()  # still: however late the I/O thread runs, nothing goes stale
    client = ControllerClient(None, Hello("srv", 0, CANDIDATES), 0.1, local=local,
                              monotonic=clock)
    try:
        for frame in telemetry_stream(7, 20, restart=False):
            client.send_telemetry(frame, decode(frame).step_index, clock())
        last = decode(frame).step_index
        wait_until(lambda: client.counters["local_decisions"] == 20, "20 local decisions")
        io_round(client)
        assert client.counters["local_decisions"] == 20
        assert client.current.apply_from_step == last + DECISION_LAG
        marker = client.marker
        assert marker.mode == CONTROLLER and set(marker.steps) <= set(CANDIDATES)
    finally:
        client.close()


def test_a_failed_local_decision_restarts_the_stream_not_the_thread(tmp_path, caplog):
    """A bug in one decision (here: the decider raises once) costs that step its answer
    and the stream its features; the I/O thread, and local mode, go on deciding."""
    path = tmp_path / "policy.npz"
    ExportedPolicy.random(seed=1).save(path)
    local = LocalDecisions(str(path), CANDIDATES)
    decide, calls = local.decider.decide, []

    def flaky(record):
        calls.append(record.step_index)
        if len(calls) == 3:
            raise RuntimeError("a bug")
        return decide(record)

    local.decider.decide = flaky
    clock = ManualClock()
    client = ControllerClient(None, Hello("srv", 0, CANDIDATES), 0.1, local=local,
                              monotonic=clock)
    try:
        frames = telemetry_stream(7, 12, restart=False)
        for frame in frames:
            client.send_telemetry(frame, decode(frame).step_index, clock())
        wait_until(lambda: client.counters["local_decisions"] == 11, "11 local decisions")
        io_round(client)
        assert client.counters["local_decide_failed"] == 1
        assert client.counters["client_thread_failed"] == 0
        assert local.decider.resets == 1
        assert client.current.apply_from_step == decode(frames[-1]).step_index + DECISION_LAG
        assert "a local decision failed" in caplog.text
    finally:
        client.close()


def test_a_changed_policy_file_is_picked_up(tmp_path):
    path = tmp_path / "policy.npz"
    ExportedPolicy.random(seed=1, name="first").save(path)
    local = LocalDecisions(str(path), CANDIDATES)
    frames = telemetry_stream(2, 8, restart=False)
    assert local.decide(frames[0]).policy == "first"
    ExportedPolicy.random(seed=2, name="second").save(path)
    local.holder.request_reload()
    assert local.decide(frames[1]).policy == "second"


def test_choose_takes_the_best_allowed_action_per_row():
    """The batched evaluation against a row-by-row reference."""
    rng = np.random.default_rng(0)
    policy = ExportedPolicy.random(seed=5, hidden=(16,))
    actions = np.asarray(policy.actions)
    rows, size = len(policy.feature_spec.batch_grid), policy.feature_spec.size
    grids = [rng.uniform(-1, 1, (rows, size)).astype(np.float32) for _ in range(6)]
    grids[2] = None  # its features failed
    grids[3][4, 7] = np.nan  # estimator overflow
    allowed = [None, allowed_actions(actions, [0, 2]), None, None,
               allowed_actions(actions, [1, 3, 6]), allowed_actions(actions, [99])]
    steps, healthy, runnable = choose(policy, actions, grids, allowed)
    assert healthy.tolist() == [True, True, False, False, True, True]
    assert runnable.tolist() == [True, True, True, True, True, False]
    for i, grid in enumerate(grids):
        if not healthy[i] or not runnable[i]:
            continue
        for r in range(rows):
            logits = policy.logits(grid[r])
            ok = [j for j in range(len(actions)) if allowed[i] is None or allowed[i][j]]
            assert steps[i, r] == actions[max(ok, key=lambda j: (logits[j], -j))]


def test_the_hub_pushes_its_policy_to_local_mode_plugins(tmp_path):
    """specctl-serve as the fleet hub: a plugin deciding locally gets the hub's policy
    when it connects and again when the hub reloads; one deciding remotely gets none."""
    hub_path, local_path = tmp_path / "hub.npz", tmp_path / "local.npz"
    ExportedPolicy.random(seed=1, name="hub-first").save(hub_path)
    ExportedPolicy.random(seed=2, name="local-own").save(local_path)
    server = ControllerServer(PolicyHolder(hub_path),
                              ServeOptions(endpoint=f"ipc://{socket_dir()}/hub.sock"))
    stop = threading.Event()
    serving = threading.Thread(target=server.run, args=(stop, 10))
    serving.start()
    local = LocalDecisions(str(local_path), CANDIDATES)
    assert local.decider.policy.name == "local-own"
    hello = Hello("srv", 0, CANDIDATES)
    client = ControllerClient(server.endpoint, hello, 5.0, local=local)
    remote = ControllerClient(server.endpoint, Hello("other", 0, CANDIDATES), 5.0)
    try:
        wait_until(lambda: local.decider.policy.name == "hub-first", "the policy on connect")
        ExportedPolicy.random(seed=3, name="hub-second").save(hub_path)
        server.holder.request_reload()
        wait_until(lambda: local.decider.policy.name == "hub-second", "the reloaded policy")
        frames = telemetry_stream(4, 5, restart=False)
        for frame in frames:
            client.send_telemetry(frame, decode(frame).step_index, time.monotonic())
        last = decode(frames[-1]).step_index
        wait_until(lambda: getattr(client.current, "apply_from_step", None)
                   == last + DECISION_LAG, "the local decision on the last telemetry")
        assert client.current.policy == "hub-second"
        assert client.counters["policy_pushes_installed"] == 2
        assert server.metrics.registry.get_sample_value("specctl_policy_pushes_total") == 2
        assert remote.counters["decisions"] == 0 and remote.counters["wire_error_kind"] == 0
        assert "policy_pushes_ignored" not in remote.counters
    finally:
        client.close()
        remote.close()
        stop.set()
        serving.join()
        server.close()


def test_a_pushed_policy_that_does_not_validate_changes_nothing(tmp_path):
    path = tmp_path / "policy.npz"
    ExportedPolicy.random(seed=1, name="mine").save(path)
    local = LocalDecisions(str(path), CANDIDATES)
    frames = telemetry_stream(5, 3, restart=False)
    broken = PolicyPush("broken", "0" * 64, b"not an npz archive")
    with pytest.raises(PolicyFileError, match="'broken' pushed by specctl-serve"):
        local.install(broken)
    assert local.install(broken) is False  # refused once, not tried again
    assert local.decide(frames[0]).policy == "mine"
    same = PolicyPush("mine", local.digest, path.read_bytes())
    assert local.install(same) is False  # already deciding with it
    other = tmp_path / "other.npz"
    ExportedPolicy.random(seed=2, name="other").save(other)
    assert local.install(PolicyPush("other", "1" * 64, other.read_bytes())) is True
    assert local.decide(frames[1]).policy == "other"


def test_policy_frames_decode_only_where_they_are_expected():
    local_hello = Hello("s", 0, (0, 3), "c", 1, policy_digest="b" * 64)
    assert decode(encode_hello(local_hello)) == local_hello  # nine items
    assert len(msgpack.unpackb(encode_hello(Hello("s", 0, (0, 3))))) == 8  # as before
    blob = bytes(range(256)) * 400  # 100 KiB: beyond a telemetry frame's limit
    frame = encode_policy(PolicyPush("p", "a" * 64, blob))
    assert decode(frame, accept_policy=True) == PolicyPush("p", "a" * 64, blob)
    with pytest.raises(WireError, match="oversized"):
        decode(frame)  # the daemon's side: never read
    with pytest.raises(WireError) as bad:
        decode(encode_policy(PolicyPush("p", "not hex", b"x")), accept_policy=True)
    assert bad.value.field == "digest"
    with pytest.raises(WireError, match="oversized"):
        decode(encode_policy(PolicyPush("p", "a" * 64, b"x" * (MAX_POLICY_BYTES + 2048))),
               accept_policy=True)
