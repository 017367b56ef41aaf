"""The plugin inside a real SGLang (one pinned version per run).

``tests/test_sglang_versions.py`` runs this file in a subprocess whose
``PYTHONPATH`` holds one SGLang version and ``SPECCTL_SGLANG_INSIDE`` names it;
run directly, it skips. SGLang's own loader (``load_plugins`` with the entry
point), ``HookRegistry``, ``AdaptiveSpeculativeParams`` and ``AdaptiveController``
are the real ones; the scheduler is the stand-in of :mod:`sglang_hooks.testing`
(SGLang's scheduler needs a GPU), its hooked methods patched by the real
``HookRegistry``.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import os
import pickle
import random
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

VERSION = os.environ.get("SPECCTL_SGLANG_INSIDE")
if not VERSION:
    pytest.skip("runs in a subprocess of tests/test_sglang_versions.py", allow_module_level=True)

import zmq  # noqa: E402

# Keep the original class in a container: HookRegistry's class REPLACE rebinds every
# module global that refers to it (that is how the patch reaches SGLang's modules).
from sglang.srt.speculative import adaptive_spec_params as asp  # noqa: E402

ORIGINAL = {"params": asp.AdaptiveSpeculativeParams}

from sglang_hooks.testing import load_plugins_as_scheduler  # noqa: E402

load_plugins_as_scheduler()

from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # noqa: E402
from sglang.srt.speculative import adaptive_runtime_state as ars  # noqa: E402

from controller.policy_file import ExportedPolicy  # noqa: E402
from controller.reload import PolicyHolder  # noqa: E402
from controller.server import ControllerServer, ServeOptions  # noqa: E402
from controller.wire import (  # noqa: E402
    DECISION_LAG,
    MAX_FRAME_BYTES,
    Decision,
    decode,
    encode_decision,
)
from env.features import FeatureSpec  # noqa: E402
from env.traces.schema import StepRecord  # noqa: E402
from sglang_hooks import adaptive_config_path, plugin  # noqa: E402
from sglang_hooks.compat import Ranks  # noqa: E402
from sglang_hooks.config import PluginConfig  # noqa: E402
from sglang_hooks.contract import HOOK_TARGETS, POLICY_CLASS  # noqa: E402
from sglang_hooks.marker import DecisionMarker  # noqa: E402
from sglang_hooks.policy import decision_table, make_policy_class  # noqa: E402
from sglang_hooks.runtime import Runtime  # noqa: E402
from sglang_hooks.testing import (  # noqa: E402
    DECODE,
    EXTEND,
    HANG_GUARD_S,
    BatchStandIn,
    ManualClock,
    RankLoop,
    ReqStandIn,
    WorkerStandIn,
    hooked_classes,
    io_round,
    socket_dir,
    wait_until,
)

CONFIG = str(adaptive_config_path())
# The scheduler targets cannot be applied here (SGLang's scheduler needs a GPU stack);
# HookRegistry retries them on every apply_hooks() and logs each failure.
logging.getLogger("sglang.srt.plugins.hook_registry").setLevel(logging.CRITICAL)
SOURCE, SECOND = Ranks(0, 2, 0, 1, 0, False), Ranks(1, 2, 0, 1, 0, False)


# -- helpers ------------------------------------------------------------------------------

_SOCKETS = socket_dir()


def ipc(name: str) -> str:
    return f"ipc://{_SOCKETS}/{name}.sock"



def constant_policy(steps: int, name: str = "constant") -> ExportedPolicy:
    """A valid policy file whose arg-max is always ``steps``."""
    spec = FeatureSpec()
    bias = np.zeros(spec.max_depth + 1, dtype=np.float32)
    bias[steps] = 1.0
    return ExportedPolicy(
        [np.zeros((spec.size, 4), np.float32), np.zeros((4, spec.max_depth + 1), np.float32)],
        [np.zeros(4, np.float32), bias], list(range(spec.max_depth + 1)), spec, name=name,
    )


def restless_policy(name: str = "restless") -> ExportedPolicy:
    """A valid policy whose choice follows the batch-size trend: it changes almost every
    step under a wandering batch size (the harshest case for keeping ranks in step)."""
    spec = FeatureSpec()
    actions = np.arange(spec.max_depth + 1)
    a = 2.0 * actions / spec.max_depth - 1.0  # each action's position in [-1, 1]
    w0 = np.zeros((spec.size, 1), np.float32)
    w0[spec.names().index("batch_trend"), 0] = 0.5  # hidden = tanh(trend / 2) ~ trend / 2
    w1 = (40.0 * a[None, :]).astype(np.float32)  # logits = 40 a h - 10 a^2: best a ~ trend
    b1 = (-10.0 * a**2).astype(np.float32)
    return ExportedPolicy([w0, w1], [np.zeros(1, np.float32), b1], actions.tolist(), spec,
                          name=name)


@contextmanager
def serving(policy: ExportedPolicy, tmp_path: Path, **options):
    """A controller (the daemon's server class) in a thread; yields its endpoint."""
    path = tmp_path / f"{policy.name}.npz"
    policy.save(path)
    server = ControllerServer(PolicyHolder(path), ServeOptions(
        endpoint=ipc(policy.name), **options))
    stop = threading.Event()
    thread = threading.Thread(target=server.run, args=(stop, 5), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        stop.set()
        thread.join(5)
        server.close()


def acceptance(step: int, steps: int, batch_size: int) -> list[int]:
    """Accepted drafts per request: a fixed function of the step, capped by its depth."""
    rng = random.Random(step)
    return [min(steps, rng.randint(0, 7)) for _ in range(batch_size)]


def build_rank(runtime: Runtime, is_source: bool, policy_class: type | None = None,
               gpu_seconds=None, overrides_log: list | None = None,
               clock: ManualClock | None = None) -> RankLoop:
    """One rank: real AdaptiveController built the way this version's EAGLEWorkerV2 does."""
    policy_class = policy_class or make_policy_class(ORIGINAL["params"], runtime)
    worker = WorkerStandIn(7, ars.SpecRuntimeState, overrides_log)
    if VERSION == "0.5.15.post1":
        # AdaptiveController builds the params from its module's global, which the
        # class REPLACE rebinds in each process; bind it to this rank's class.
        saved = ars.AdaptiveSpeculativeParams
        ars.AdaptiveSpeculativeParams = policy_class
        try:
            adaptive = ars.AdaptiveController(worker, config_path=CONFIG)
        finally:
            ars.AdaptiveSpeculativeParams = saved
    else:
        adaptive = ars.AdaptiveController(
            worker, policy_class(initial_steps=worker.speculative_num_steps, cfg_path=CONFIG))
    adaptive.init_states(None)
    scheduler_class, receiver_class = hooked_classes(runtime)
    scheduler = scheduler_class(adaptive, worker, acceptance, gpu_seconds=gpu_seconds,
                                clock=clock)
    return RankLoop(scheduler, receiver_class(is_source))


def runtime(ranks: Ranks = SOURCE, monotonic=time.monotonic, **cfg) -> Runtime:
    cfg.setdefault("server", "test")
    return Runtime(PluginConfig(**cfg), VERSION, ranks=ranks, monotonic=monotonic)


def next_batch(i: int, reqs: list[ReqStandIn]) -> BatchStandIn:
    """Mostly decode; a prefill every 10th step; the batch size wanders."""
    if i % 10 == 3:
        return BatchStandIn(reqs[:2], EXTEND, extend_num_tokens=512)
    size = 1 + (i * 7) % len(reqs)
    return BatchStandIn(reqs[:size], DECODE)


def run_single(loop: RankLoop, iterations: int, sleep_s: float = 0.001,
               on_iteration=None) -> None:
    reqs = [ReqStandIn(f"r{i}") for i in range(48)]
    for i in range(iterations):
        pulled = loop.pull() or []  # a lone non-source rank has nobody to hear from
        loop.iterate(pickle.loads(pickle.dumps(pulled)), next_batch(i, reqs))
        if on_iteration is not None:
            on_iteration(i)
        time.sleep(sleep_s)
    loop.drain()


def decode_steps(loop: RankLoop) -> list[int]:
    return [steps for _, steps in loop.scheduler.launched]


# -- loader and registry ----------------------------------------------------------------


def test_entry_point_registers_the_policy_class_and_the_hooks():
    rt = plugin.RUNTIME
    assert rt is not None and rt.cfg.controller == os.environ["SPECCTL_CONTROLLER"]
    patched = asp.AdaptiveSpeculativeParams
    assert patched is not ORIGINAL["params"] and issubclass(patched, ORIGINAL["params"])
    assert patched._specctl is rt
    if VERSION == "0.5.15.post1":  # AdaptiveController builds it from this global
        assert ars.AdaptiveSpeculativeParams is patched
    assert POLICY_CLASS in HookRegistry._patched
    expected = {
        "_pull_raw_reqs": (HookType.AFTER, rt.after_pull_raw_reqs),
        "process_input_requests": (HookType.BEFORE, rt.before_process_input_requests),
        "run_batch": (HookType.AROUND, rt.around_run_batch),
        "process_batch_result": (HookType.AROUND, rt.around_process_batch_result),
    }
    for target in HOOK_TARGETS:
        [(hook_type, hook, source)] = HookRegistry._hooks[target.target]
        assert (hook_type, hook) == expected[target.name]
        assert source.plugin_name == "specctl"


def test_sglang_builds_the_plugin_policy_with_every_candidate_state():
    worker = WorkerStandIn(7, ars.SpecRuntimeState)
    if VERSION == "0.5.15.post1":
        adaptive = ars.AdaptiveController(worker, config_path=CONFIG)
    else:  # what EAGLEWorkerV2.__init__ does in 0.5.23
        adaptive = ars.AdaptiveController(
            worker, asp.AdaptiveSpeculativeParams(initial_steps=7, cfg_path=CONFIG))
    assert type(adaptive.params) is asp.AdaptiveSpeculativeParams
    assert plugin.RUNTIME.policy is adaptive.params
    adaptive.init_states(None)
    assert adaptive.candidate_steps == list(range(8))
    assert sorted(adaptive._states) == list(range(8))


# -- the controller in charge ----------------------------------------------------------------


def in_step_with_the_controller(rt: Runtime, loop: RankLoop, clock: ManualClock,
                                step_s: float) -> None:
    """After a step of ``loop``: once the live controller has answered anything, wait
    for its answer to this step's telemetry (forward_ct is the step in flight), then
    move ``clock`` one step on and let the client take it. Before the first answer (not
    connected yet: what was sent is dropped) the clock is held. Which decision applies
    where is then set by the steps, never by how loaded the machine is: on a real clock
    a controller thread not run for a tenth of a second is a timeout."""
    client = rt.client
    if client.answered_step < 0:
        time.sleep(0.001)
        return
    wait_until(lambda: client.answered_step >= loop.scheduler.forward_ct - 1,
               "the controller's answer to the last step")
    clock.advance(step_s)
    io_round(client)  # the next step sees the answer, aged at the new time


def run_with_live_controller(loop: RankLoop, rt: Runtime, clock: ManualClock, done,
                             step_s: float = 0.001) -> int:
    """Iterate ``loop`` in step with the live controller until ``done()``."""
    reqs = [ReqStandIn(f"r{i}") for i in range(48)]
    give_up = time.monotonic() + HANG_GUARD_S
    i = 0
    while not done():
        assert time.monotonic() < give_up, f"stuck after {i} iterations, {rt.counters}"
        loop.iterate(pickle.loads(pickle.dumps(loop.pull() or [])), next_batch(i, reqs))
        in_step_with_the_controller(rt, loop, clock, step_s)
        i += 1
    loop.drain()
    return i


def test_controller_decisions_drive_the_real_adaptive_controller(tmp_path):
    """In step with the controller on a manual clock (a loaded machine cannot make a
    decision late)."""
    clock = ManualClock()
    rt = runtime(controller=ipc("constant"), fallback="table", table=((1, 2),),
                 monotonic=clock)
    loop = build_rank(rt, is_source=True)

    def decode_steps_since_the_first_5() -> int:
        steps = decode_steps(loop)
        return len(steps) - steps.index(5) if 5 in steps else 0

    with serving(constant_policy(5), tmp_path) as server:
        run_with_live_controller(loop, rt, clock, lambda: decode_steps_since_the_first_5() >= 100)
        stale = rt.client.counters["decisions_stale"]
        rt.close()
    steps = decode_steps(loop)
    first = steps.index(5)
    assert set(steps[:first]) == {2}, "the local rule runs until the first decision"
    assert set(steps[first:]) == {5}, "then every decode step runs the controller's depth"
    assert loop.scheduler.worker.switches == 2  # initial 7 -> rule's 2 -> controller's 5
    assert server.metrics.registry.get_sample_value("specctl_decisions_total") > 50
    assert stale == 0
    assert not any(k.startswith("fault") for k in rt.counters), rt.counters
    assert not any(type(r) is DecisionMarker for r in loop.scheduler.dispatched)


def test_local_mode_decides_in_process_and_every_rank_follows(tmp_path):
    """SPECCTL_POLICY: no controller; the source's I/O thread decides, markers carry it.
    On a manual clock, each step waits for a round of the I/O thread: which step the
    first answer reaches does not depend on how loaded the machine is."""
    path = tmp_path / "constant.npz"
    constant_policy(5).save(path)
    clock = ManualClock()
    ranks = [runtime(SOURCE, policy=str(path), fallback="table", table=((1, 2),),
                     monotonic=clock),
             runtime(SECOND, fallback="table", table=((1, 2),), monotonic=clock)]
    loops = [build_rank(ranks[0], True), build_rank(ranks[1], False)]
    reqs = [ReqStandIn(f"r{i}") for i in range(48)]
    for i in range(150):
        broadcast = pickle.dumps(loops[0].pull() or [])
        for loop in loops:
            loop.iterate(pickle.loads(broadcast), next_batch(i, reqs))
        clock.advance(0.002)
        io_round(ranks[0].client)  # this step's telemetry decided, its marker published
    for loop in loops:
        loop.drain()
    counters = dict(ranks[0].client.counters)
    for rt in ranks:
        rt.close()
    steps = [decode_steps(loop) for loop in loops]
    assert steps[0] == steps[1], "every rank runs the same depth at every step"
    first = steps[0].index(5)
    assert set(steps[0][:first]) == {2} and set(steps[0][first:]) == {5}
    assert first < 20  # no connection, no round trip: the first step's answer
    assert counters["local_decisions"] >= 100 and "telemetry_sent" not in counters
    assert not any(k.startswith("fault") for rt in ranks for k in rt.counters)


def test_a_decision_applies_from_its_step_on_every_rank_and_markers_stay_internal():
    rt = runtime(min_switch_steps=1)
    loop = build_rank(rt, is_source=True)
    rt.attach(loop.scheduler)  # no controller: attach markers by hand
    reqs = [ReqStandIn("a"), ReqStandIn("b")]
    marker = DecisionMarker(1, "controller", apply_from_step=5, batch_grid=(1, 2), steps=(3, 6))
    for i in range(8):
        broadcast = [marker, ReqStandIn("x")] if i == 1 else []
        loop.iterate(broadcast, BatchStandIn(reqs[: 1 + i % 2], DECODE))
    loop.drain()
    launched = loop.scheduler.launched
    assert [s for i, s in launched if i < 5] == [7, 7, 7, 7]  # SGLang's rule, initial 7
    assert [s for i, s in launched if i >= 5] == [3, 6, 3, 6]  # by batch size (1 -> 3, 2 -> 6)
    assert [type(r) for r in loop.scheduler.dispatched] == [ReqStandIn]


def test_two_ranks_apply_the_same_steps_on_every_step_under_broadcast_delays(tmp_path):
    policy = restless_policy()
    endpoint = ipc("restless")
    clock = ManualClock()  # in step with the controller: see in_step_with_the_controller
    ranks = [runtime(SOURCE, controller=endpoint, monotonic=clock),
             runtime(SECOND, controller=endpoint, monotonic=clock)]
    loops = [build_rank(ranks[0], True), build_rank(ranks[1], False)]
    for rt, loop in zip(ranks, loops, strict=True):
        rt.attach(loop.scheduler)
    assert ranks[0].is_source and not ranks[1].is_source
    reqs = [ReqStandIn(f"r{i}") for i in range(48)]
    channel: list[bytes] = []
    ready = threading.Condition()
    iterations = 300

    def rank1() -> None:
        rng = random.Random(1)
        for i in range(iterations):
            with ready:
                ready.wait_for(lambda i=i: len(channel) > i, timeout=30)
            time.sleep(rng.choice([0, 0, 0, 0.002, 0.01]))  # this rank runs late
            loops[1].iterate(pickle.loads(channel[i]), next_batch(i, reqs))
        loops[1].drain()

    rng = random.Random(0)
    with serving(policy, tmp_path):
        follower = threading.Thread(target=rank1)
        follower.start()
        for i in range(iterations):
            pulled = loops[0].pull()
            with ready:
                channel.append(pickle.dumps(pulled))  # broadcast_pyobj pickles the list
                ready.notify_all()
            # Decisions keep arriving between the pull and the launch (broadcast and
            # scheduling take time): the source must not act on them until they ride
            # the next broadcast.
            time.sleep(rng.choice([0, 0.0005, 0.002]))
            loops[0].iterate(pickle.loads(channel[i]), next_batch(i, reqs))
            in_step_with_the_controller(ranks[0], loops[0], clock, 0.002)
        loops[0].drain()
        follower.join(60)
    ranks[0].close()
    a, b = (loop.scheduler.launched for loop in loops)
    assert len(a) == len(b) > 200
    assert a == b
    assert len({s for _, s in a}) >= 4, "the policy should move the depth around"
    assert ranks[0].counters["markers_controller"] >= 30


def test_the_fallback_rule_is_sglangs_own_rule_on_its_default_tiers():
    """The shipped config is one flat slot: the fallback is SGLang's rule on its default
    tiers (what ``--speculative-adaptive`` without a config file runs)."""
    rt = runtime(fallback="sglang", min_switch_steps=1)
    loop = build_rank(rt, is_source=True)
    reference = ORIGINAL["params"](initial_steps=7, cfg_path=None)
    ours = loop.scheduler.adaptive.params
    seen = set()
    for step in range(1, 400):
        size = 1 + step % 12  # the default tiers' slots 1 and 8
        rt.launch_step = step
        steps = ours.get_steps_for_batch(size)
        assert steps == reference.get_steps_for_batch(size)
        seen.add(steps)
        drafts = acceptance(step, steps, size)
        ours.on_verify_complete(drafts, size)
        reference.on_verify_complete(drafts, size)
    assert len(seen) >= 2, "SGLang's rule should have moved (else the comparison is vacuous)"
    flat = ORIGINAL["params"](initial_steps=7, cfg_path=CONFIG)
    assert flat.get_steps_for_batch(64) != ours.get_steps_for_batch(64), \
        "the flat config's own slot ignores batch size; the default tiers do not"


def test_sglangs_rule_keeps_learning_while_the_controller_is_in_charge():
    rt = runtime(fallback="sglang", min_switch_steps=1)
    loop = build_rank(rt, is_source=True)
    ours = loop.scheduler.adaptive.params
    reference = ORIGINAL["params"](initial_steps=7, cfg_path=None)
    rt.controller = DecisionMarker(1, "controller", 0, (1,), (7,))
    before = reference.get_steps_for_batch(1)
    for step in range(1, 120):
        rt.launch_step = step
        assert ours.get_steps_for_batch(1) == 7  # the controller's depth runs
        rt.verify_steps = 7
        drafts = [1, 0, 2]  # poor acceptance at depth 7
        ours.on_verify_complete(drafts, 3)
        own = reference._route(3).current_steps
        reference.on_verify_complete([min(d, own) for d in drafts], 3)
        if step % 10 == 0:  # a step that did not speculate teaches nothing
            rt.verify_steps = 0
            ours.on_verify_complete([0, 0, 0], 3)
    rt.controller = None
    assert ours.get_steps_for_batch(3) == reference.get_steps_for_batch(3) < before, \
        "the fallback starts from live acceptance, not from where it was left"


def test_sglangs_rule_is_fed_where_sglang_routes_after_its_cuda_graph_sizes_change():
    """The feed looks SGLang's routing up once per batch size; when SGLang sets its CUDA
    graph sizes (again), a batch of 3 pads to 8 and feeds the default tiers' slot 8."""
    rt = runtime(fallback="sglang", min_switch_steps=1)
    loop = build_rank(rt, is_source=True)
    ours = loop.scheduler.adaptive.params
    reference = ORIGINAL["params"](initial_steps=7, cfg_path=None)
    rt.controller = DecisionMarker(1, "controller", 0, (1,), (7,))

    def feed(steps: int) -> None:
        for _ in range(steps):
            rt.verify_steps = 7
            drafts = [1, 0, 2]  # poor acceptance at depth 7
            ours.on_verify_complete(drafts, 3)
            own = reference._route(3).current_steps
            reference.on_verify_complete([min(d, own) for d in drafts], 3)

    feed(30)
    at_eight = reference.get_steps_for_batch(8)
    ours.set_cuda_graph_bs([8, 16])
    reference.set_cuda_graph_bs([8, 16])
    feed(60)
    rt.controller = None
    assert reference.get_steps_for_batch(8) != at_eight, "slot 8 should have learnt"
    for size in (1, 3, 8, 12):
        assert ours.get_steps_for_batch(size) == reference.get_steps_for_batch(size), size
    # what each slot learnt, exactly (fed at the wrong slot's depth, slot 8's would differ)
    assert ([slot.ema_accept_len for slot in ours._specctl_rule._slots.values()]
            == [slot.ema_accept_len for slot in reference._slots.values()])


def _feed_reference(reference, drafts: list[int], size: int, ran: int) -> None:
    """SGLang's rule fed as the policy feeds its own: at the rule's depth, nothing from a
    step that did not speculate."""
    own = reference._route(size).current_steps
    if ran != 0 or own <= 0:
        reference.on_verify_complete([min(d, own) for d in drafts] if ran > own > 0
                                     else drafts, size)


@pytest.mark.parametrize("io_thread", [False, True])
def test_a_deferred_feed_leaves_sglangs_rule_where_feeding_every_verify_does(io_thread):
    """With the feeding deferred (the source with a client), a verify only queues; the
    client's thread (here a thread feeding at random moments) or the rule's next question
    feeds the queue in order: at the fallback, and across a change of CUDA graph sizes,
    the rule's every slot is where feeding at each verify leaves SGLang's own."""
    rt = runtime(fallback="sglang", min_switch_steps=1)
    loop = build_rank(rt, is_source=True)
    rt.defer_rule_feed = True
    ours = loop.scheduler.adaptive.params
    reference = ORIGINAL["params"](initial_steps=7, cfg_path=None)
    rt.controller = DecisionMarker(1, "controller", 0, (1,), (7,))
    rng = random.Random(3)
    stop = threading.Event()

    def io() -> None:
        while not stop.is_set():
            ours.specctl_feed_rule()
            time.sleep(rng.choice([0, 0.0001, 0.001]))

    feeder = threading.Thread(target=io, daemon=True)
    if io_thread:
        feeder.start()
    try:
        for step in range(1, 300):
            if step == 150:
                ours.set_cuda_graph_bs([8, 16])
                reference.set_cuda_graph_bs([8, 16])
            size = rng.choice([1, 2, 3, 5, 9, 12, 20])
            rt.launch_step = step
            assert ours.get_steps_for_batch(size) == 7  # the controller's depth runs
            ran = rt.verify_steps = 0 if step % 10 == 0 else 7
            quality = 0.2 if step < 200 else 0.9  # the rule must move down, then up
            drafts = [sum(1 for _ in range(ran) if rng.random() < quality)
                      for _ in range(size)]
            ours.on_verify_complete(drafts, size)
            _feed_reference(reference, drafts, size, ran)
    finally:
        stop.set()
        if io_thread:
            feeder.join(10)
    if not io_thread:
        # Fed when SGLang set its CUDA graph sizes (at step 150): queued since.
        assert len(ours._specctl_feeds) == 150, "every verify should have been queued"
    rt.controller = None
    for size in (1, 3, 8, 12, 20):
        assert ours.get_steps_for_batch(size) == reference.get_steps_for_batch(size), size
    assert not ours._specctl_feeds
    assert ([(slot.ema_accept_len, slot._batch_count, slot.current_steps)
             for slot in ours._specctl_rule._slots.values()]
            == [(slot.ema_accept_len, slot._batch_count, slot.current_steps)
                for slot in reference._slots.values()])


def test_the_source_with_a_client_defers_the_feed_to_the_clients_thread(monkeypatch):
    """A source that opens a client hands the feeding to it; without one, or on any
    other rank, each verify feeds the rule at once."""
    chores, marker_chores = [], []

    class Client:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def add_chore(self, chore) -> None:
            chores.append(chore)

        def add_marker_chore(self, chore) -> None:
            marker_chores.append(chore)

    monkeypatch.setattr("sglang_hooks.runtime.ControllerClient", Client)
    with_client = runtime(fallback="sglang", controller="ipc:///nowhere")
    without = runtime(fallback="sglang")
    for rt in (with_client, without):
        rt.attach(build_rank(rt, is_source=True).scheduler)
        assert rt.is_source
    assert with_client.defer_rule_feed and not without.defer_rule_feed
    assert chores == [with_client.policy.specctl_feed_rule]
    assert marker_chores == [with_client.policy.specctl_prepare]  # markers tabled there too
    for rt in (with_client, without):
        params = rt.policy
        slot = params._specctl_rule._route(1)
        before = slot.ema_accept_len
        rt.verify_steps = 7
        params.on_verify_complete([0, 0], 1)
        assert (slot.ema_accept_len == before) == rt.defer_rule_feed
    chores[0]()
    assert with_client.policy._specctl_rule._route(1).ema_accept_len != before


def test_table_rule_and_clamping_to_candidate_steps():
    rt = runtime(fallback="table", table=((1, 3), (16, 1), (64, 0)), min_switch_steps=1)
    loop = build_rank(rt, is_source=True)
    params = loop.scheduler.adaptive.params
    assert [params.get_steps_for_batch(b) for b in (1, 15, 16, 63, 64, 500)] == [3, 3, 1, 1, 0, 0]
    rt.controller = DecisionMarker(1, "controller", 0, (1,), (11,))
    assert params.get_steps_for_batch(4) == 7 and rt.counters["clamped"] == 1


def test_a_decisions_steps_are_clamped_where_sglang_routes_after_its_graph_sizes_change(
        tmp_path):
    """The policy remembers a decision's clamped steps per batch size; when SGLang sets its
    CUDA graph sizes a batch of 3 pads to 8 and is clamped to that slot's candidates."""
    config = tmp_path / "tiers.json"
    config.write_text(json.dumps({"1": {"candidate_steps": [1, 3, 7]},
                                  "8": {"candidate_steps": [1, 2]}}))
    rt = runtime(fallback="table", table=((1, 3),), min_switch_steps=1)
    params = make_policy_class(ORIGINAL["params"], rt)(initial_steps=3, cfg_path=str(config))
    rt.controller = DecisionMarker(1, "controller", 0, (1,), (7,))
    assert [params.get_steps_for_batch(3) for _ in range(2)] == [7, 7]
    assert params.get_steps_for_batch(9) == 2 and rt.counters["clamped"] == 1
    params.set_cuda_graph_bs([8, 16])
    assert params.get_steps_for_batch(3) == 2 and rt.counters["clamped"] == 2
    rt.controller = DecisionMarker(2, "controller", 0, (1, 5), (1, 3))
    assert params.get_steps_for_batch(3) == 1  # a new decision: looked up again
    assert params.get_steps_for_batch(5) == 2 and rt.counters["clamped"] == 3


@pytest.mark.parametrize("ready", [False, True])
def test_every_answer_sets_the_off_switchs_flag_as_its_choice_would(ready):
    """The policy's answer goes through the off switch, with or without an off path
    built: ``off_now`` is set anew at every answer, a stale True cleared."""
    rt = runtime(fallback="table", table=((1, 3),), min_switch_steps=1)
    params = make_policy_class(ORIGINAL["params"], rt)(initial_steps=3, cfg_path=CONFIG)
    switch = rt.offswitch
    switch.ready = ready
    answers = []
    for seq in (1, 2):
        switch.off_now = True  # left over from an earlier step
        rt.controller = DecisionMarker(seq, "controller", 0, (1,), (3,))
        answers.append(params.get_steps_for_batch(1))
        assert not switch.off_now
    assert answers == [3, 3]


# A decision's steps per batch size, tabled (on the source by the client's I/O thread)
# against SGLang's own routing and the old one-by-one lookup.

_tiers = st.dictionaries(st.integers(1, 600), st.lists(st.integers(0, 9), min_size=1, max_size=5),
                         min_size=1, max_size=4)
_graph_bs = st.none() | st.lists(st.integers(1, 1100), min_size=1, max_size=8, unique=True)
_grids = st.lists(st.integers(1, 3000), min_size=1, max_size=8, unique=True).map(sorted)


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(tiers=_tiers, graph_bs=_graph_bs, grids=st.lists(_grids, min_size=1, max_size=3),
       data=st.data())
def test_a_decisions_table_answers_what_sglangs_routing_and_the_lookup_do(tiers, graph_bs,
                                                                          grids, data):
    """Tabled by the I/O thread, looked up one by one (other ranks), or past the table's
    end: every batch size gets SGLang's slot's candidate nearest to the decision's steps
    (ties: the smaller; 127 for more), the clamp counted, and the table's entries are the
    one-by-one lookup's."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({str(bs): {"candidate_steps": c} for bs, c in tiers.items()}, f)
    rt = runtime(fallback="table", table=((1, 3),), min_switch_steps=1)
    params = make_policy_class(ORIGINAL["params"], rt)(initial_steps=3, cfg_path=f.name)
    os.unlink(f.name)
    params.set_cuda_graph_bs(graph_bs)
    size = params._specctl_routes[0]
    sizes = [0, 1, size - 1, size, size + 1, *data.draw(
        st.lists(st.integers(0, 4000), max_size=20))]
    for seq, grid in enumerate(grids, 1):
        steps = tuple(data.draw(st.lists(st.integers(0, 200), min_size=len(grid),
                                         max_size=len(grid))))
        marker = DecisionMarker(seq, "controller", 0, tuple(grid), steps)
        prepared = data.draw(st.booleans())
        if prepared:
            params.specctl_prepare(marker)
        rt.controller = marker
        for batch_size in sizes:
            want = marker.steps_for(batch_size)
            slot = ORIGINAL["params"]._route(params, batch_size)
            expected = min(slot.candidate_steps, key=lambda c: (abs(c - min(want, 127)), c))
            clamped = rt.counters["clamped"]
            assert params.get_steps_for_batch(batch_size) == expected, (batch_size, marker)
            assert rt.counters["clamped"] - clamped == (expected != want)
        applied = params._specctl_memo[1]
        assert applied is params._specctl_prepared[0][2] if prepared else applied == []
        routes = params._specctl_routes
        table = decision_table(marker.batch_grid, marker.steps, routes[1], routes[0])
        assert len(table) == size
        for batch_size in range(size):
            assert table[batch_size] == params._specctl_lookup(marker, batch_size)
            assert table[batch_size][2] is params._specctl_lookup(marker, batch_size)[2]
    assert rt.counters["faults"] == 0


def test_a_table_prepared_before_sglang_sets_its_graph_sizes_is_not_used_after(tmp_path):
    """The I/O thread tabled a marker under the old routing; SGLang then set its CUDA graph
    sizes (a batch of 3 now pads to 8, whose slot offers 1 and 2): the table is rebuilt."""
    config = tmp_path / "tiers.json"
    config.write_text(json.dumps({"1": {"candidate_steps": [1, 3, 7]},
                                  "8": {"candidate_steps": [1, 2]}}))
    rt = runtime(fallback="table", table=((1, 3),), min_switch_steps=1)
    params = make_policy_class(ORIGINAL["params"], rt)(initial_steps=3, cfg_path=str(config))
    marker = DecisionMarker(1, "controller", 0, (1,), (7,))
    params.specctl_prepare(marker)
    params.set_cuda_graph_bs([8, 16])
    rt.controller = marker
    assert params.get_steps_for_batch(3) == 2
    assert params._specctl_memo[1] == []  # looked up one by one instead
    params.specctl_prepare(marker2 := marker._replace(seq=2))
    rt.controller = marker2
    assert params.get_steps_for_batch(3) == 2
    assert params._specctl_memo[1] is params._specctl_prepared[0][2]  # prepared: used


def test_a_broken_table_is_a_fault_and_sglang_answers():
    rt = runtime(fallback="table", table=((1, 3),), min_switch_steps=1)
    params = make_policy_class(ORIGINAL["params"], rt)(initial_steps=3, cfg_path=CONFIG)
    marker = DecisionMarker(1, "controller", 0, (1,), (5,))
    params.specctl_prepare(marker)
    params._specctl_prepared[0][2][4] = None  # a bug's stand-in
    rt.controller = marker
    assert params.get_steps_for_batch(4) == ORIGINAL["params"].get_steps_for_batch(params, 4)
    assert rt.counters["fault_policy"] == 1


# -- faults ---------------------------------------------------------------------------------


def _serve_process(policy: ExportedPolicy, tmp_path: Path, endpoint: str) -> subprocess.Popen:
    path = tmp_path / "serve.npz"
    policy.save(path)
    process = subprocess.Popen(
        [sys.executable, "-m", "controller.cli", f"policy={path}", f"endpoint={endpoint}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    for line in process.stdout:
        if "serving policy" in line:
            return process
    raise AssertionError(f"specctl-serve did not start (exit {process.wait()})")


def test_controller_killed_and_restarted_mid_stream(tmp_path):
    """Time is a manual clock: 2 ms a step while the controller keeps pace (or is dead);
    held while a live controller's answer is on its way, however loaded the machine."""
    clock = ManualClock()
    endpoint = ipc("serve")
    rt = runtime(controller=endpoint, fallback="table", table=((1, 2),), timeout_s=0.05,
                 monotonic=clock)
    loop = build_rank(rt, is_source=True)
    reqs = [ReqStandIn(f"r{i}") for i in range(48)]
    process = _serve_process(constant_policy(6), tmp_path, endpoint)
    launched = loop.scheduler.launched
    events: dict[str, int] = {}
    give_up = time.monotonic() + 120  # a hang guard only

    def kept_pace() -> bool:
        """The controller answered the telemetry of the step whose result was just
        processed (forward_ct is the one in flight)."""
        return rt.client.answered_step >= loop.scheduler.forward_ct - 1

    def run_until(done, alive: bool) -> None:
        i = 0
        while not done():
            assert time.monotonic() < give_up, f"stuck at {events}, counters {rt.counters}"
            pulled = loop.pull()
            loop.iterate(pickle.loads(pickle.dumps(pulled)), next_batch(i, reqs))
            i += 1
            if not alive or kept_pace():
                clock.advance(0.002)
                io_round(rt.client)  # the next step sees the answer, aged at the new time
            else:
                time.sleep(0.001)  # let the live controller's answer arrive

    def steps_after(step: int) -> list[int]:
        return [s for i, s in launched if i > step]

    def followed(after_step: int, count: int) -> bool:
        """``count`` decode steps launched since the controller's 6 first ran."""
        steps = steps_after(after_step)
        return 6 in steps and len(steps) - steps.index(6) >= count

    try:
        # in charge for 100 decode steps, then killed
        run_until(lambda: followed(0, 100), alive=True)
        process.kill()
        process.wait()
        events["killed"] = loop.scheduler.forward_ct
        # dead for 200 decode steps
        run_until(lambda: len(steps_after(events["killed"])) >= 200, alive=False)
        process = _serve_process(constant_policy(6), tmp_path, endpoint)
        events["restarted"] = loop.scheduler.forward_ct
        # back, and followed for 150 decode steps
        run_until(lambda: followed(events["restarted"], 150), alive=True)
        loop.drain()
    finally:
        process.kill()
        process.wait()
        rt.close()
    before = [s for i, s in launched if i <= events["killed"]]
    assert set(before[before.index(6):]) == {6}
    dead = [(i, s) for i, s in launched if events["killed"] < i <= events["restarted"]]
    fallback_from = next(i for i, s in dead if s == 2)
    # Timeout 50 ms at 2 ms per step: fallback within ~40 steps of the kill, and then
    # steadily until the controller is back.
    assert fallback_from - events["killed"] < 40
    assert all(s == 2 for i, s in dead if i >= fallback_from)
    back = steps_after(events["restarted"])
    assert set(back[back.index(6):]) == {6}, "decisions resume and stay once it is back"
    assert rt.counters["timeouts"] >= 1
    assert not any(k.startswith("fault") for k in rt.counters), rt.counters


class RawController:
    """A hand-written controller: answers each telemetry with ``reply(record)``, held
    until ``delay_s`` after it arrived on ``clock`` (the test's manual clock)."""

    def __init__(self, endpoint: str, reply, clock: ManualClock, delay_s: float = 0.0) -> None:
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.ROUTER)
        self.sock.bind(endpoint)
        self.reply, self.clock, self.delay_s = reply, clock, delay_s
        self.lock = threading.Lock()
        self.queue: list[tuple[float, bytes, list[bytes]]] = []
        #: Step of the newest telemetry received (-1: none yet); replies sent so far.
        self.last_step, self.replies = -1, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if self.sock.poll(1):
                identity, frame = self.sock.recv_multipart()
                message = decode(frame)
                if isinstance(message, StepRecord):
                    with self.lock:
                        self.queue.append((self.clock() + self.delay_s, identity,
                                           self.reply(message)))
                        self.last_step = message.step_index
            with self.lock:
                while self.queue and self.queue[0][0] <= self.clock():
                    _, identity, frames = self.queue.pop(0)
                    for frame in frames:
                        self.sock.send_multipart([identity, frame])
                    self.replies += 1

    def nothing_due(self) -> bool:
        """Every reply due by the clock's time has been sent."""
        with self.lock:
            return not self.queue or self.queue[0][0] > self.clock()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.context.term()


def _decision(record: StepRecord, steps: int) -> bytes:
    return encode_decision(Decision(record.step_index, record.step_index + DECISION_LAG, "raw",
                                    (1,), (steps,)))


def run_lockstep(loop: RankLoop, rt: Runtime, raw: RawController, clock: ManualClock,
                 iterations: int) -> None:
    """``run_single`` at 2 ms a step on ``clock``, each step taken only once the
    controller has the previous step's telemetry and the client every reply due: what
    arrives when is set by the clock, never by how loaded the machine is."""
    reqs = [ReqStandIn(f"r{i}") for i in range(48)]

    def taken() -> int:  # replies the client's I/O thread has taken (one decision each)
        counters = rt.client.counters
        return (counters["decisions"] + counters["decisions_stale"]
                + counters["decisions_out_of_order"])

    for i in range(iterations):
        loop.iterate(pickle.loads(pickle.dumps(loop.pull())), next_batch(i, reqs))
        if raw.last_step < 0:  # not connected yet: what was sent is dropped
            time.sleep(0.001)
            continue
        wait_until(lambda: raw.last_step >= loop.scheduler.forward_ct - 1, "telemetry")
        clock.advance(0.002)
        wait_until(lambda: raw.nothing_due() and taken() >= raw.replies, "replies")
        io_round(rt.client)  # aged at the clock's new reading, the marker published
    loop.drain()


@pytest.mark.parametrize(("delay_s", "in_charge"), [(0.15, False), (0.005, True)])
def test_slow_controller_is_ignored_fast_one_is_followed(tmp_path, delay_s, in_charge):
    clock = ManualClock()
    endpoint = ipc(f"raw-{delay_s}")
    raw = RawController(endpoint, lambda r: [_decision(r, 4)], clock, delay_s=delay_s)
    rt = runtime(controller=endpoint, fallback="table", table=((1, 1),), timeout_s=0.05,
                 monotonic=clock)
    loop = build_rank(rt, is_source=True)
    try:
        run_lockstep(loop, rt, raw, clock, 200)
        stale = rt.client.counters["decisions_stale"]
    finally:
        raw.close()
        rt.close()
    late = {s for i, s in loop.scheduler.launched if i > 120}
    assert late == ({4} if in_charge else {1})
    assert (stale > 0) is not in_charge
    assert not any(k.startswith("fault") for k in rt.counters), rt.counters


def test_garbage_and_oversized_replies_are_counted_and_survived(tmp_path):
    endpoint = ipc("garbage")

    def reply(record: StepRecord) -> list[bytes]:
        return [b"\xc1garbage", b"\x00" * (MAX_FRAME_BYTES + 10),
                encode_decision(Decision(0, 0, "x"))[:-3], _decision(record, 3)]

    clock = ManualClock()
    raw = RawController(endpoint, reply, clock)
    rt = runtime(controller=endpoint, fallback="table", table=((1, 1),), monotonic=clock)
    loop = build_rank(rt, is_source=True)
    try:
        run_lockstep(loop, rt, raw, clock, 120)
        counters = dict(rt.client.counters)
    finally:
        raw.close()
        rt.close()
    steps = [s for _, s in loop.scheduler.launched]
    assert 3 in steps and set(steps[steps.index(3):]) == {3}
    assert len(steps) - steps.index(3) > 60
    assert counters["wire_error_garbage"] > 10 and counters["wire_error_oversized"] > 10
    assert not any(k.startswith("fault") for k in rt.counters), rt.counters


# -- record mode ---------------------------------------------------------------------------------


def test_record_mode_with_exploration_writes_a_valid_trace(tmp_path):
    from env.traces.trace_format import read_trace

    rt = runtime(record_dir=str(tmp_path / "trace"), record_explore=True, explore_dwell=2)
    loop = build_rank(rt, is_source=True)
    reqs = [ReqStandIn(f"q{i}", prompt_tokens=10 + i) for i in range(8)]
    arrivals = [replace_rid(r) for r in reqs]
    for i in range(200):
        broadcast = arrivals if i == 0 else []
        batch = (BatchStandIn(reqs, EXTEND, extend_num_tokens=100) if i == 0
                 else BatchStandIn(reqs, DECODE))
        if i == 150:
            for r in reqs[:5]:
                r.finished_reason = "length"
        loop.iterate(broadcast, batch)
    loop.drain()
    rt.close()
    trace = read_trace(sorted((tmp_path / "trace").glob("*.parquet")))
    steps = trace.steps
    assert [s.step_index for s in steps] == list(range(1, 201))
    decode = [s for s in steps if s.prefill_tokens == 0]
    assert {s.steps_used for s in decode} == set(range(8)), "every depth explored"
    assert all(len(s.accepted_drafts) == (8 if s.steps_used else 0) for s in decode)
    assert all(s.accepted_drafts.max(initial=0) <= s.steps_used for s in decode)
    assert steps[0].prefill_tokens == 100 and steps[0].request_ids == [r.rid for r in reqs]
    # the same launch order as what the scheduler ran
    assert [s.steps_used for s in decode] == [s for _, s in loop.scheduler.launched]
    records = trace.requests.records()
    assert sorted(r.request_id for r in records) == [f"q{i}" for i in range(5)]
    assert all(r.output_tokens >= 1 and r.prompt_tokens == 10 + int(r.request_id[1:])
               for r in records)


class _Arrival:
    """What the tokenizer sends the scheduler: a request id and its prompt."""

    def __init__(self, rid: str, n: int) -> None:
        self.rid, self.input_ids = rid, list(range(n))


def replace_rid(req: ReqStandIn) -> _Arrival:
    return _Arrival(req.rid, len(req.origin_input_ids))


def test_exploration_is_the_same_on_every_rank():
    loops = []
    for ranks in (SOURCE, SECOND):
        rt = runtime(ranks, record_explore=True, explore_dwell=3)
        loops.append(build_rank(rt, is_source=ranks is SOURCE))
    for loop in loops:
        run_single(loop, 120, sleep_s=0)
    a, b = (loop.scheduler.launched for loop in loops)
    assert a == b and {s for _, s in a} == set(range(8))


def test_step_latency_is_the_steps_own_gpu_time_under_overlap(tmp_path):
    """Launch-to-launch would report step N-1's duration under overlap scheduling.
    The GPU runs on a manual clock, so the expected latencies are exact."""
    from env.traces.trace_format import read_trace

    def gpu_seconds(steps: int) -> float:
        return 0.004 + 0.003 * steps  # 4 ms plain decode, +3 ms per draft step

    clock = ManualClock()
    rt = runtime(record_dir=str(tmp_path / "trace"), record_explore=True, explore_dwell=1,
                 monotonic=clock)
    loop = build_rank(rt, is_source=True, gpu_seconds=gpu_seconds, clock=clock)
    reqs = [ReqStandIn(f"g{i}") for i in range(4)]
    for _ in range(120):
        loop.iterate([], BatchStandIn(reqs, DECODE))  # depth changes every step
    loop.drain()
    rt.close()
    steps = read_trace(sorted((tmp_path / "trace").glob("*.parquet"))).steps[5:]
    assert len(steps) > 100
    own = np.array([s.step_latency_s - gpu_seconds(s.steps_used) for s in steps])
    assert np.abs(own).max() < 1e-6
    # the previous step's GPU time is off by 3 ms per depth of difference
    pairs = [(p, s) for p, s in itertools.pairwise(steps) if p.steps_used != s.steps_used]
    assert len(pairs) > 100
    previous = np.array([abs(s.step_latency_s - gpu_seconds(p.steps_used)) for p, s in pairs])
    assert previous.min() > 0.003 - 1e-6


def test_hook_timing_writes_per_step_percentiles(tmp_path):
    import json

    prefix = str(tmp_path / "hooks")
    rt = runtime(fallback="table", table=((1, 3),), hook_timing=prefix)
    loop = build_rank(rt, is_source=True)
    rt.clock.path = prefix + ".json"  # one file for the test instead of one per pid
    run_single(loop, 60, sleep_s=0)
    rt.clock.write()
    summary = json.loads(Path(prefix + ".json").read_text())
    assert summary["steps"] >= 59
    assert 0 < summary["p50_us"] <= summary["p99_us"] <= summary["max_us"]
    assert summary["p50_us"] < 10_000  # the scheduler stand-in's own sleeps are excluded


def test_hook_timing_leaves_out_sglangs_own_rule(tmp_path):
    """The policy's methods call SGLang's own rule (its steps, its acceptance update):
    SGLang runs that without the plugin too, so its time is not the plugin's."""
    import json

    class SlowRule(ORIGINAL["params"]):  # SGLang's rule, 20 ms a call
        def get_steps_for_batch(self, batch_size):
            time.sleep(0.02)
            return super().get_steps_for_batch(batch_size)

        def on_verify_complete(self, num_correct_drafts_per_req, batch_size):
            time.sleep(0.02)
            return super().on_verify_complete(num_correct_drafts_per_req, batch_size)

    prefix = str(tmp_path / "hooks")
    rt = runtime(hook_timing=prefix)  # the local rule is SGLang's: called every step
    loop = build_rank(rt, is_source=True, policy_class=make_policy_class(SlowRule, rt))
    rt.clock.path = prefix + ".json"
    run_single(loop, 20, sleep_s=0)
    rt.clock.write()
    summary = json.loads(Path(prefix + ".json").read_text())
    assert summary["steps"] >= 19
    assert summary["p50_us"] < 20_000  # each decode step called the 20 ms rule twice


# -- ranks without the variables, switch rate ---------------------------------------------


def test_a_rank_without_the_variables_strips_and_follows_the_sources_markers(tmp_path):
    """Other nodes of a multi-node TP group: no SPECCTL_* there. Without the follower
    hooks, SGLang's dispatcher would raise on the first marker (the stand-in does too)."""
    endpoint = ipc("follow")
    clock = ManualClock()  # in step with the controller: see in_step_with_the_controller
    source = runtime(SOURCE, controller=endpoint, fallback="table", table=((1, 2), (16, 5)),
                     min_switch_steps=3, monotonic=clock)
    follower = Runtime(PluginConfig(), VERSION, ranks=SECOND, follower=True)
    loops = [build_rank(source, True), build_rank(follower, False)]
    reqs = [ReqStandIn(f"r{i}") for i in range(48)]
    with serving(restless_policy("follow"), tmp_path):
        for i in range(250):
            broadcast = pickle.dumps(loops[0].pull())
            batch = (BatchStandIn(reqs[:4], EXTEND, extend_num_tokens=64) if i == 0
                     else next_batch(i, reqs))  # a server's first batch is a prefill
            for loop in loops:
                loop.iterate(pickle.loads(broadcast), batch.copy())
            in_step_with_the_controller(source, loops[0], clock, 0.001)
        for loop in loops:
            loop.drain()
    source.close()
    a, b = (loop.scheduler.launched for loop in loops)
    assert a == b and len(a) > 200
    assert follower.local == source.local  # the announced rule, not a default
    assert source.counters["markers_controller"] >= 10
    assert len({s for _, s in a}) >= 3
    assert not any(k.startswith("fault") for k in follower.counters), follower.counters
    with pytest.raises(ValueError, match="Invalid object"):  # what the hooks prevent
        type(loops[1].scheduler).__mro__[1].process_input_requests(
            loops[1].scheduler, [DecisionMarker(1, "fallback", 0)])


def test_a_follower_is_sglang_itself_until_a_source_speaks():
    follower = Runtime(PluginConfig(), VERSION, ranks=SECOND, follower=True)
    ours = build_rank(follower, False).scheduler.adaptive.params
    reference = ORIGINAL["params"](initial_steps=7, cfg_path=CONFIG)
    switched = []
    for step in range(1, 200):
        assert ours.get_steps_for_batch(4) == reference.get_steps_for_batch(4)
        drafts = [min(reference.get_steps_for_batch(4), step % 3)] * 4
        new = ours.on_verify_complete(drafts, 4)
        assert new == reference.on_verify_complete(drafts, 4)  # immediate switches too
        switched.append(new)
    assert any(s is not None for s in switched)


def _gloo_rank(rank: int, init_file: str, endpoint: str, out: str) -> None:
    """One TP rank in its own process: SGLang's broadcast_pyobj over gloo carries the
    request list (and the markers) from rank 0, as in ``_broadcast_reqs_across_ranks``."""
    import json

    import torch.distributed as dist
    from sglang.srt.utils import broadcast_pyobj

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=2)
    clock = ManualClock()  # in step with the controller: see in_step_with_the_controller
    if rank == 0:
        rt = runtime(SOURCE, controller=endpoint, fallback="table", table=((1, 3), (16, 1)),
                     monotonic=clock)
    else:  # this process has none of the SPECCTL_* variables
        rt = Runtime(PluginConfig(), VERSION, ranks=SECOND, follower=True)
    loop = build_rank(rt, is_source=rank == 0)
    reqs = [ReqStandIn(f"r{i}") for i in range(48)]
    error = None
    try:
        for i in range(200):
            pulled = loop.pull() if rank == 0 else None
            received = broadcast_pyobj(pulled or [], rank, None, src=0)
            batch = (BatchStandIn(reqs[:4], EXTEND, extend_num_tokens=64) if i == 0
                     else next_batch(i, reqs))
            loop.iterate(received, batch)
            if rank == 0:
                in_step_with_the_controller(rt, loop, clock, 0.002)
        loop.drain()
    except Exception as exc:  # reported to the parent, which fails the test
        error = repr(exc)
    rt.close()
    Path(out).write_text(json.dumps({
        "launched": loop.scheduler.launched, "error": error,
        "dispatched": [type(r).__name__ for r in loop.scheduler.dispatched],
        "faults": {k: v for k, v in rt.counters.items() if k.startswith("fault")},
        "markers": rt.counters["markers_controller"]}))
    dist.destroy_process_group()


def test_two_gloo_ranks_one_without_the_variables(tmp_path):
    import json
    import multiprocessing

    endpoint = ipc("gloo")
    fork = multiprocessing.get_context("fork")  # the children inherit the loaded SGLang
    with serving(restless_policy("gloo"), tmp_path):
        ranks = [fork.Process(target=_gloo_rank, args=(r, str(tmp_path / "rdv"), endpoint,
                                                        str(tmp_path / f"rank{r}.json")))
                 for r in (0, 1)]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join(120)
    assert [p.exitcode for p in ranks] == [0, 0]
    a, b = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert a["error"] is None and b["error"] is None, (a["error"], b["error"])
    assert a["launched"] == b["launched"] and len(a["launched"]) > 150
    assert a["markers"] >= 5 and len({s for _, s in a["launched"]}) >= 3
    assert a["faults"] == b["faults"] == {}
    assert a["dispatched"] == b["dispatched"] == []  # nothing but markers was sent


def _alternate_on_two_ranks(marker: DecisionMarker, steps: int) -> tuple[object, list[int]]:
    """Two ranks (``min_switch_steps`` 4) given ``marker`` (grid (1, 2) -> steps (3, 6)) and
    then ``steps`` decode batches of 1 and 2 requests in turn, so the decision alternates
    3 / 6: the source rank's runtime and the steps where the launched depth switched,
    asserted the same on both ranks."""
    ranks = [runtime(SOURCE, min_switch_steps=4), runtime(SECOND, min_switch_steps=4)]
    loops = [build_rank(rt, is_source=rt is ranks[0]) for rt in ranks]
    reqs = [ReqStandIn("a"), ReqStandIn("b")]
    for i in range(steps):
        for loop in loops:
            loop.iterate([marker] if i == 0 else [], BatchStandIn(reqs[: 1 + i % 2], DECODE))
    for loop in loops:
        loop.drain()
    a, b = (loop.scheduler.launched for loop in loops)
    assert a == b
    return ranks[0], [i for (i, s), (_, p) in itertools.pairwise(a) if s != p]


def test_dwell_spaces_switches_the_same_on_every_rank():
    marker = DecisionMarker(1, "controller", apply_from_step=1, batch_grid=(1, 2), steps=(3, 6))
    source, switches = _alternate_on_two_ranks(marker, 200)
    assert len(switches) >= 30
    assert min(y - x for x, y in itertools.pairwise(switches)) >= 4
    assert source.counters["switches_held"] > 50


def test_an_unheld_decision_is_neither_held_nor_holds_a_later_switch():
    """The start rule's decisions (DECISION ``flags``: ``unheld``): the alternating decision
    of the test above switches at every step, on every rank, with nothing held; and an
    unheld off right after an ordinary switch to depth 6 runs at once."""
    marker = DecisionMarker(1, "controller", apply_from_step=1, batch_grid=(1, 2), steps=(3, 6),
                            unheld=True)
    source, switches = _alternate_on_two_ranks(marker, 100)
    assert len(switches) >= 90
    assert source.counters["switches_held"] == 0

    one = [ReqStandIn("a")]
    rt = runtime(SOURCE, min_switch_steps=4)
    loop = build_rank(rt, is_source=True)
    six = DecisionMarker(1, "controller", apply_from_step=1, batch_grid=(1,), steps=(6,))
    off = DecisionMarker(2, "controller", apply_from_step=1, batch_grid=(1,), steps=(0,),
                         unheld=True)
    back = DecisionMarker(3, "controller", apply_from_step=1, batch_grid=(1,), steps=(3,))
    for i in range(8):
        markers = {0: [six], 1: [off], 4: [back]}.get(i, [])
        loop.iterate(markers, BatchStandIn(one, DECODE))
    loop.drain()
    ran = [s for _, s in loop.scheduler.launched]
    held = runtime(SOURCE, min_switch_steps=4)
    held_loop = build_rank(held, is_source=True)
    for i in range(8):
        markers = {0: [six], 1: [off._replace(unheld=False)], 4: [back]}.get(i, [])
        held_loop.iterate(markers, BatchStandIn(one, DECODE))
    held_loop.drain()
    ran_held = [s for _, s in held_loop.scheduler.launched]
    assert ran_held[:4] == [6, 6, 6, 6]  # ordinary: the hold keeps depth 6 for 4 steps
    assert ran[0] == 6 and ran[1] != 6  # unheld: off at once (SGLang's steps 0)
    assert rt.counters["switches_held"] == 0


def test_many_switches_leave_sglangs_overrides_log_bounded():
    from sglang.srt.runtime_context import get_context

    context = get_context()
    if VERSION == "0.5.15.post1":  # keeps no overrides log: nothing to trim
        rt = runtime()
        build_rank(rt, is_source=False)
        rt.attach(None)
        assert not hasattr(context, "_overrides_log") and rt.trimmer is None
        return
    log = context._overrides_log
    log.append(("startup", {"speculative_num_steps": 7}))
    start = len(log)
    rt = runtime(min_switch_steps=1)
    loop = build_rank(rt, is_source=False, overrides_log=log)
    reqs = [ReqStandIn("a"), ReqStandIn("b")]
    marker = DecisionMarker(1, "controller", apply_from_step=1, batch_grid=(1, 2), steps=(3, 6))
    for i in range(2000):
        loop.iterate([marker] if i == 0 else [], BatchStandIn(reqs[: 1 + i % 2], DECODE))
    loop.drain()
    assert loop.scheduler.worker.switches >= 1999
    assert len(log) == start + 1  # the last switch: what /server_info overlays
    assert log[-1] == ("adaptive_spec.restore",
                       {"speculative_num_steps": 6, "speculative_num_draft_tokens": 7})
    assert log[start - 1] == ("startup", {"speculative_num_steps": 7})
    assert rt.trimmer.trimmed >= 1998


def test_sglangs_switch_log_line_is_filtered_and_counted():
    """Installed by the plugin (configured here) on SGLang's EAGLE worker logger only."""
    from sglang_hooks.switching import SWITCH_LOGGER, SwitchLogFilter

    logger = logging.getLogger(SWITCH_LOGGER)
    [installed] = [f for f in logger.filters if isinstance(f, SwitchLogFilter)]
    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    level, logger.level = logger.level, logging.INFO
    before = installed.dropped
    try:
        logger.info("Switch adaptive runtime state: steps 3 -> 5, draft_tokens 4 -> 6")
        logger.info("Built adaptive runtime state steps=5: elapsed=1.00s, mem=0.10GB")
    finally:
        logger.removeHandler(handler)
        logger.level = level
    assert seen == ["Built adaptive runtime state steps=5: elapsed=1.00s, mem=0.10GB"]
    assert installed.dropped == before + 1


# -- the start-up warm-up (--warmups specctl) ---------------------------------------------------

WARM = "specctl-warmup-"


class _Client:
    """Stands in for the controller client: keeps every step the source sends."""

    def __init__(self) -> None:
        self.marker = None
        self.sent: list[tuple] = []
        self.counters: dict = {}

    def send_step(self, raw: tuple) -> None:
        self.sent.append(raw)

    def close(self) -> None:
        pass


def warm_then_serve(loops: list[RankLoop], sizes=(1, 2, 4, 8), decode_steps: int = 10,
                    serve: int = 12, finish: bool = False) -> list[tuple[str, int, bool]]:
    """The warm-up's traffic as the scheduler sees it, then real traffic: per ramp size,
    its warm-up requests arrive, one prefill, ``decode_steps`` decode steps; then 6 real
    requests arrive, one prefill, ``serve`` decode steps. Returns (kind, batch size, warm-up
    batch) per launched batch, in step order. ``finish``: every batch's requests finish at
    its last decode step (the recorder writes request rows for finished requests)."""
    plan = []
    for size in sizes:
        plan.append([ReqStandIn(f"{WARM}77-{size}-{i}") for i in range(size)])
    plan.append([ReqStandIn(f"user-{i}") for i in range(6)])
    launched = []
    for reqs in plan:
        warm = reqs[0].rid.startswith(WARM)
        count = decode_steps if warm else serve
        arrivals = [replace_rid(r) for r in reqs]
        for i in range(1 + count):
            broadcast = pickle.dumps((loops[0].pull() or []) + (arrivals if i == 0 else []))
            if finish and i == count:
                for r in reqs:
                    r.finished_reason = "length"
            batch = (BatchStandIn(reqs, EXTEND, extend_num_tokens=16 * len(reqs)) if i == 0
                     else BatchStandIn(reqs, DECODE))
            launched.append(("extend" if i == 0 else "decode", len(reqs), warm))
            for loop in loops:
                loop.iterate(pickle.loads(broadcast), batch.copy())
    for loop in loops:
        loop.drain()
    return launched


def warm_ranks(ready: bool, **cfg) -> tuple[list[Runtime], list[RankLoop]]:
    """A source, a second rank with the variables and a follower without them."""
    cfg = {"fallback": "table", "table": ((1, 3),), "min_switch_steps": 4, **cfg}
    ranks = [runtime(SOURCE, **cfg), runtime(SECOND, **cfg),
             Runtime(PluginConfig(), VERSION, ranks=Ranks(2, 3, 0, 1, 0, False), follower=True)]
    loops = [build_rank(rt, is_source=rt is ranks[0]) for rt in ranks]
    for rt in ranks:
        rt.offswitch.ready = ready  # with the plain-decode off path, as on a GPU
    return ranks, loops


@pytest.mark.parametrize("ready", [False, True])
def test_warmup_batches_run_every_depth_at_every_bucket_the_same_on_every_rank(ready):
    """Ten decode steps per batch are enough: the cycle is nine long (off, the first depth
    twice, the rest), and one step of it may be the off path's return step."""
    ranks, loops = warm_ranks(ready)
    launched = warm_then_serve(loops)
    runs = [loop.scheduler.launched for loop in loops]
    assert runs[0] == runs[1] == runs[2], "every rank runs the same depth at every step"
    decode = [(size, warm) for kind, size, warm in launched if kind == "decode"]
    depths = [steps for _, steps in runs[0]]
    assert len(depths) == len(decode)
    for size in (1, 2, 4, 8):
        ran = {d for (s, warm), d in zip(decode, depths, strict=True) if warm and s == size}
        assert ran == set(range(8)), f"batch {size}: depths {sorted(ran)}"
    served = [d for (_, warm), d in zip(decode, depths, strict=True) if not warm]
    assert served == [3] * 12, "after the warm-up the rule runs, from its first step"
    assert ranks[0].counters["warmup_steps"] == 40 and ranks[0].warm_steps == 40
    assert not ranks[0].warming
    assert not any(k.startswith("fault") for rt in ranks for k in rt.counters)


def test_warmup_steps_are_neither_sent_nor_recorded(tmp_path):
    from env.traces.trace_format import read_trace

    ranks, loops = warm_ranks(False, record_dir=str(tmp_path / "trace"))
    source = ranks[0]
    source.attach(loops[0].scheduler)
    source.client = client = _Client()
    launched = warm_then_serve(loops, finish=True)
    source.close()
    open_requests = set(source.recorder._open)  # arrivals seen, not finished
    real = [i + 1 for i, (_, _, warm) in enumerate(launched) if not warm]
    assert len(real) == 13 and len(launched) == 13 + 4 * 11
    assert [raw[0][0] for raw in client.sent] == real, "only the real steps reach the client"
    trace = read_trace(sorted((tmp_path / "trace").glob("*.parquet")))
    assert [s.step_index for s in trace.steps] == real
    assert sorted(r.request_id for r in trace.requests.records()) == [
        f"user-{i}" for i in range(6)]
    assert not any(rid.startswith(WARM) for rid in open_requests), "arrivals not recorded"
    assert source.counters["warmup_results"] == 4 * 11
    assert "unmatched_results" not in source.counters
    assert "telemetry_overwritten" not in source.counters, "warm-up launches not captured"


def test_a_warmup_does_not_feed_sglangs_rule():
    ranks, loops = warm_ranks(False, fallback="sglang")
    rule = loops[0].scheduler.adaptive.params._specctl_rule
    before = copy.deepcopy({bs: vars(slot) for bs, slot in rule._slots.items()})
    warm_then_serve(loops, serve=0)
    assert {bs: vars(slot) for bs, slot in rule._slots.items()} == before
    assert ranks[0].counters["warmup_steps"] == 40


def test_outside_a_warmup_batches_are_untouched():
    """A batch without a warm-up request while one is open, and a warm-up-like request
    after real traffic (the warm-up is over for good), both run the rule."""
    ranks, loops = warm_ranks(False, min_switch_steps=1)
    warm = [ReqStandIn(f"{WARM}1-{i}") for i in range(2)]
    other = [ReqStandIn(f"not-{WARM}{i}") for i in range(3)]
    script = [([replace_rid(r) for r in warm], BatchStandIn(warm, EXTEND, 32)),
              ([], BatchStandIn(warm, DECODE)),
              ([], BatchStandIn(other, DECODE)),  # open warm-up, no warm-up request in it
              ([], BatchStandIn(warm, DECODE)),
              ([replace_rid(other[0])], BatchStandIn(other, DECODE)),  # real: closed
              ([replace_rid(warm[0])], BatchStandIn(warm, DECODE)),  # too late to open
              ([], BatchStandIn(warm, DECODE))]
    for broadcast, batch in script:
        payload = pickle.dumps((loops[0].pull() or []) + broadcast)
        for loop in loops:
            loop.iterate(pickle.loads(payload), batch.copy())
    for loop in loops:
        loop.drain()
    runs = [[s for _, s in loop.scheduler.launched] for loop in loops]
    assert runs[0] == runs[1] == runs[2]
    assert runs[0] == [0, 3, 1, 3, 3, 3]  # warm-up positions 1 and 2 of the cycle: 0, 1
    assert ranks[0].counters["warmup_steps"] == 2 and not ranks[0].warming
