"""Online costs of specctl, each next to its floor measured in the same run.

Not a test: run it, read the table, keep the JSON. Medians over ``--runs`` (default 3).

    python benchmarks/bench_online.py --out runs/bench_online.json

(a) ``hooks``: the scheduler-thread time the plugin adds per step. The stand-in
    scheduler of :mod:`sglang_hooks.testing` runs batches of 64 requests (a
    2-request prefill every 50 steps) in overlap order: plain (SGLang's own
    ``AdaptiveSpeculativeParams``, no hooks), with four do-nothing hooks (the floor:
    ``HookRegistry``'s dispatch), and with the plugin (source rank with a live
    ``specctl-serve``; the same recording; a non-source rank; the source with
    ``SPECCTL_HOOK_TIMING``, whose own clock is reported too). Each iteration (pull,
    broadcast as a pickle round trip, input processing, launch, result processing) is
    timed in thread CPU; steps are 1 ms apart so decisions arrive between them as on
    a real server. Needs SGLang (``--sglang``, default ``.sglang/0.5.23``).
(b) ``rtt``: 1 and 8 servers at 1 kHz (one cheap client process) against
    ``specctl-serve`` and against a bare pyzmq ROUTER + msgpack echo (the floor).
    Reported: the fraction of steps answered within the plugin's timeout, latency of
    the answered steps, and latency of all steps (an unanswered one counts as never);
    the same for steps *covered* (by an answer to them or to a later step of their
    server, which folded their telemetry: the plugin waits for nothing older once that
    arrives); and the CPU cores the answering and the client process used.
(d) ``local``: the plugin's local decision mode at 1 kHz: from telemetry queued (as
    the hooks queue it) to the decision on it, made on the client's I/O thread.
(c) ``throughput``: 128 streams, each keeping one telemetry message in flight
    (closed loop), against ``specctl-serve`` and the echo: decisions per second and
    per CPU-second of the answering process.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import multiprocessing as mp
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from controller.policy_file import ExportedPolicy  # noqa: E402
from controller.wire import DECISION_LAG, encode_step  # noqa: E402
from env.traces.schema import StepRecord  # noqa: E402


def percentiles(values_ns: list[float] | np.ndarray, scale: float = 1e-3) -> dict:
    v = np.asarray(values_ns, dtype=float) * scale
    return {"p50": float(np.percentile(v, 50)), "p99": float(np.percentile(v, 99)),
            "max": float(v.max()), "n": int(v.size)}


def _pct(values_us: np.ndarray) -> dict:
    """p50/p99 (``inf`` stands for never; nearest rank, so no inf - inf)."""
    if not values_us.size:
        return {"p50": float("nan"), "p99": float("nan"), "n": 0}
    return {"p50": float(np.percentile(values_us, 50, method="nearest")),
            "p99": float(np.percentile(values_us, 99, method="nearest")),
            "n": int(values_us.size)}


def connect_servers(endpoint: str, names: list[str], client: str):
    """One DEALER per server name, each said HELLO, all on one poller (as the plugin's
    client sets its socket up). Returns (context, poller, sockets, socket -> index)."""
    import zmq

    from controller.wire import Hello, apply_socket_limits, encode_hello

    context = zmq.Context()
    poller = zmq.Poller()
    socks = []
    for name in names:
        sock = context.socket(zmq.DEALER)
        apply_socket_limits(sock)
        sock.setsockopt(zmq.SNDHWM, 64)
        sock.connect(endpoint)
        sock.send(encode_hello(Hello(name, 0, tuple(range(8)), client, os.getpid())))
        poller.register(sock, zmq.POLLIN)
        socks.append(sock)
    return context, poller, socks, {sock: i for i, sock in enumerate(socks)}


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds the process (all its threads) has used so far."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_for_socket(endpoint: str, alive, timeout_s: float = 30.0) -> None:
    """Until ``endpoint`` accepts connections; raises if ``alive()`` turns False first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if endpoint.startswith("ipc://") and os.path.exists(endpoint[6:]):
            return
        if endpoint.startswith("tcp://"):
            host, port = endpoint[6:].rsplit(":", 1)
            try:
                socket.create_connection((host, int(port)), timeout=0.2).close()
                return
            except OSError:
                pass
        if not alive():
            raise RuntimeError(f"the server for {endpoint} exited")
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {endpoint}")


def start_bound(command: list[str], endpoint: str, name: str,
                env: dict | None = None) -> subprocess.Popen:
    """``command`` in a process of its own, from the repository; returns once it has bound
    ``endpoint`` (a process that dies first: RuntimeError with its output, named ``name``)."""
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=env)
    try:
        wait_for_socket(endpoint, lambda: process.poll() is None)
    except RuntimeError as exc:
        process.kill()
        raise RuntimeError(f"{name}: {exc}: {process.communicate()[0]}") from None
    return process


def start_controller(policy: Path, endpoint: str, *overrides: str) -> subprocess.Popen:
    """``specctl-serve`` in a process of its own; returns once its socket is bound."""
    return start_bound([sys.executable, "-m", "controller.cli", f"policy={policy}",
                        f"endpoint={endpoint}", "log_level=WARNING", *overrides],
                       endpoint, "specctl-serve")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def telemetry(server: str, step: int, batch: int = 32) -> bytes:
    accepted = np.random.default_rng(step).integers(0, 4, size=batch).astype(np.int8)
    return encode_step(StepRecord(server, 0, step, step * 0.01, batch, 4, batch, 50_000,
                                  500_000, 0, 3, accepted, 0.012))


# -- (a) hook cost ----------------------------------------------------------------------


class EmptyHooks:
    """The floor of the hook cost: the plugin's four hooks, each doing nothing, applied
    by SGLang's ``HookRegistry`` like the plugin's (the registry's dispatch is the cost)."""

    @staticmethod
    def _after(result, *args, **kwargs):
        return None

    @staticmethod
    def _before(*args, **kwargs):
        return None

    @staticmethod
    def _around(original, *args, **kwargs):
        return original(*args, **kwargs)

    def hook_table(self) -> dict:
        return {"_pull_raw_reqs": (self._after, "AFTER"),
                "process_input_requests": (self._before, "BEFORE"),
                "run_batch": (self._around, "AROUND"),
                "process_batch_result": (self._around, "AROUND")}

    def attach(self, scheduler) -> None:
        pass


class TimedEmptyHooks(EmptyHooks):
    """The floor on the plugin's own clock: the four do-nothing hooks wrapped by the
    ``HookClock`` that ``SPECCTL_HOOK_TIMING`` uses (``run_batch`` ends a step, as the
    plugin's does), so that the plugin's clock has a floor read the same way."""

    def __init__(self, path: str) -> None:
        from sglang_hooks.timing import HookClock

        self.clock = HookClock(path, write_every_s=0)

    def _launch(self, original, *args, **kwargs):
        self.clock.end_step()
        return original(*args, **kwargs)

    def hook_table(self) -> dict:
        clock = self.clock
        return {"_pull_raw_reqs": (clock.plain(self._after, "_pull_raw_reqs"), "AFTER"),
                "process_input_requests": (clock.plain(
                    self._before, "process_input_requests", starts_iteration=True), "BEFORE"),
                "run_batch": (clock.around(self._launch, "run_batch"), "AROUND"),
                "process_batch_result": (clock.around(self._around, "process_batch_result"),
                                         "AROUND")}


def rank_loop_builder(sglang_path: Path, workdir: Path):
    """A function ``build(runtime, is_source, params_class=None) -> RankLoop``: one rank of
    the stand-in scheduler with SGLang's real adaptive controller (``runtime`` None: no
    hooks, SGLang's own params; an :class:`EmptyHooks` or a ``Runtime``: its hooks applied
    by SGLang's ``HookRegistry``; ``params_class`` replaces the params class built).
    Needs SGLang at ``sglang_path`` (put on ``sys.path`` here)."""
    from sglang_hooks.testing import write_import_stand_ins

    stand_ins = workdir / "stand-ins"
    write_import_stand_ins(stand_ins)
    sys.path[1:1] = [str(sglang_path), str(stand_ins)]
    from sglang.srt.speculative import adaptive_runtime_state as ars
    from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams

    from sglang_hooks import adaptive_config_path
    from sglang_hooks.policy import make_policy_class
    from sglang_hooks.runtime import Runtime
    from sglang_hooks.testing import (
        RankLoop,
        ReceiverStandIn,
        SchedulerStandIn,
        WorkerStandIn,
        hooked_classes,
    )

    config = str(adaptive_config_path())

    def acceptance(step: int, steps: int, batch: int) -> list[int]:
        return [min(steps, (step * 7 + i) % 5) for i in range(batch)]

    def build(rt, is_source: bool, params_class: type | None = None) -> RankLoop:
        worker = WorkerStandIn(3, ars.SpecRuntimeState)
        if params_class is None:
            params_class = (make_policy_class(AdaptiveSpeculativeParams, rt)
                            if isinstance(rt, Runtime) else AdaptiveSpeculativeParams)
        params = params_class(initial_steps=3, cfg_path=config)
        if "policy" in inspect.signature(ars.AdaptiveController.__init__).parameters:
            adaptive = ars.AdaptiveController(worker, params)
        else:  # 0.5.15.post1 builds its own params: use ours instead
            adaptive = ars.AdaptiveController(worker, config)
            adaptive.params = params
        adaptive.init_states(None)
        if rt is None:
            scheduler, receiver = SchedulerStandIn, ReceiverStandIn
        else:
            scheduler, receiver = hooked_classes(rt)
        loop = RankLoop(scheduler(adaptive, worker, acceptance), receiver(is_source))
        if rt is not None:
            rt.attach(loop.scheduler)
        return loop

    return build


def scheduler_batch(i: int, reqs: list):
    """The benchmark's batch at iteration ``i``: 64-request decode, a 2-request prefill
    every 50 steps."""
    from sglang_hooks.testing import DECODE, EXTEND, BatchStandIn

    return (BatchStandIn(reqs[:2], EXTEND, extend_num_tokens=1024) if i % 50 == 7
            else BatchStandIn(reqs, DECODE))


def bench_hooks(sglang_path: Path, iterations: int, workdir: Path) -> dict:
    build = rank_loop_builder(sglang_path, workdir)
    from sglang_hooks.compat import Ranks, installed_version
    from sglang_hooks.config import PluginConfig
    from sglang_hooks.runtime import Runtime
    from sglang_hooks.testing import RankLoop, ReqStandIn

    version = installed_version()

    def measure(loops: dict[str, RankLoop]) -> dict[str, list[int]]:
        """Run the loops in lock-step (one iteration each, in turn) so that drift in the
        machine's load hits all of them alike."""
        reqs = [ReqStandIn(f"r{i}") for i in range(64)]
        times = {name: ([], []) for name in loops}  # (wall, thread CPU) per iteration
        for i in range(iterations):
            for name, loop in loops.items():
                batch = scheduler_batch(i, reqs)
                wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
                pulled = loop.pull()
                broadcast = pickle.loads(pickle.dumps(pulled)) if pulled else []
                loop.iterate(broadcast, batch)
                times[name][1].append(time.thread_time_ns() - cpu)
                times[name][0].append(time.perf_counter_ns() - wall)
                time.sleep(0.001 / len(loops))
        for loop in loops.values():
            loop.drain()
        skip = iterations // 10
        return {name: (np.asarray(w[skip:]), np.asarray(c[skip:]))
                for name, (w, c) in times.items()}

    policy = workdir / "policy.npz"
    ExportedPolicy.random(seed=0).save(policy)
    endpoint = f"ipc://{workdir}/hooks.sock"
    controller = start_controller(policy, endpoint)
    runtimes = {
        "source": Runtime(PluginConfig(server="a", controller=endpoint), version,
                          ranks=Ranks(0, 2, 0, 1, 0, False)),
        # The same with SPECCTL_HOOK_TIMING: the plugin's own clock (its cost subtracted).
        "source_timed": Runtime(
            PluginConfig(server="d", controller=endpoint,
                         hook_timing=str(workdir / "hook-timing")),
            version, ranks=Ranks(0, 2, 0, 1, 0, False)),
        "source_recording": Runtime(
            PluginConfig(server="b", controller=endpoint, record_dir=str(workdir / "rec")),
            version, ranks=Ranks(0, 2, 0, 1, 0, False)),
        # Local decision mode: the policy evaluated on the I/O thread of this process.
        "source_local": Runtime(PluginConfig(server="f", policy=str(policy)), version,
                                ranks=Ranks(0, 2, 0, 1, 0, False)),
        "other_rank": Runtime(PluginConfig(server="c", controller=endpoint), version,
                              ranks=Ranks(1, 2, 0, 1, 0, False)),
    }
    try:
        empty_timed = TimedEmptyHooks(str(workdir / "empty-timing.json"))
        loops = {"plain": build(None, True), "empty_hooks": build(EmptyHooks(), True),
                 "empty_timed": build(empty_timed, True)}
        loops.update({name: build(rt, name != "other_rank") for name, rt in runtimes.items()})
        times = measure(loops)
        clock = runtimes["source_timed"].clock.summary()
        empty_clock = empty_timed.clock.summary()
    finally:
        controller.kill()
        counters = {name: {**rt.counters, **(rt.client.counters if rt.client else {})}
                    for name, rt in runtimes.items()}
        for rt in runtimes.values():
            rt.close()
    plain_wall, plain_cpu = times["plain"]
    results = {"plain": {**percentiles(plain_wall), "cpu": percentiles(plain_cpu)}}
    for name in ("empty_hooks", "empty_timed", *runtimes):
        wall, cpu = times[name]
        results[name] = {
            **percentiles(wall),
            "cpu": percentiles(cpu),
            # What the plugin adds: hooked minus plain, at the same percentile. Wall
            # time includes preemption by other processes; thread CPU time does not.
            "added_p50": (np.percentile(wall, 50) - np.percentile(plain_wall, 50)) / 1e3,
            "added_p99": (np.percentile(wall, 99) - np.percentile(plain_wall, 99)) / 1e3,
            "added_cpu_p50": (np.percentile(cpu, 50) - np.percentile(plain_cpu, 50)) / 1e3,
            "added_cpu_p99": (np.percentile(cpu, 99) - np.percentile(plain_cpu, 99)) / 1e3,
            "counters": counters.get(name, {}),
        }
    results["source_clock"] = clock
    results["empty_clock"] = empty_clock
    return results


# -- (b) round trip ---------------------------------------------------------------------


def paced_clients(endpoint: str, names: list[str], seconds: float, rate_hz: float,
                  on_sent, on_answer, on_start=None) -> tuple[int, float]:
    """Servers ``names`` stepping at ``rate_hz`` (staggered: server i at ``start + (k + i /
    n) * period``), one DEALER each, one poller for all: the round-trip benchmarks' client.

    Calls ``on_sent(i, step, sent_ns)`` before each telemetry is sent (a full queue drops it:
    unanswered) and ``on_answer(i, answered_step, arrived_ns)`` for each decision read;
    ``on_start()``, if given, once the HELLOs are in, just before the first step.
    Returns (steps sent, wall seconds).
    """
    import msgpack
    import zmq

    from controller.wire import pack_telemetry

    _context, poller, socks, index = connect_servers(endpoint, names, "bench")  # kept alive
    accepted = bytes(np.random.default_rng(0).integers(0, 4, size=32).astype(np.int8))
    total = sum(accepted)
    steps = [0] * len(names)
    period = 1.0 / rate_hz
    time.sleep(0.3)  # HELLOs in
    if on_start is not None:
        on_start()
    start = time.perf_counter()
    due = [start + i * period / len(names) for i in range(len(names))]
    end = start + seconds
    while True:
        now = time.perf_counter()
        if now >= end:
            break
        for i, sock in enumerate(socks):
            if now >= due[i]:
                due[i] += period
                steps[i] += 1
                step = steps[i]
                frame = pack_telemetry(names[i], 0, step, now, 32, 4, 32, 50_000, 500_000, 0, 3,
                                       accepted, total, 0.012)
                on_sent(i, step, time.perf_counter_ns())
                with contextlib.suppress(zmq.Again):  # counted as unanswered
                    sock.send(frame, zmq.NOBLOCK)
        wait_ms = max(0.0, (min(due) - time.perf_counter()) * 1e3)
        for sock, _ in poller.poll(math.ceil(wait_ms)):
            i = index[sock]
            while sock.get(zmq.EVENTS) & zmq.POLLIN:
                arrived = time.perf_counter_ns()
                message = msgpack.unpackb(sock.recv(zmq.NOBLOCK))
                on_answer(i, message[3] - DECISION_LAG, arrived)  # DECISION: apply_from_step
    return sum(steps), time.perf_counter() - start


def _rtt_clients(endpoint: str, names: list[str], seconds: float, rate_hz: float,
                 timeout_s: float, out, ready, server_pid: int | None = None) -> None:
    """:func:`paced_clients` against ``endpoint``, latencies kept.

    Cheap on purpose (one process, prepacked accepted drafts, only the answered step read
    back): eight client processes on a 2-core machine would measure the clients.
    Puts (steps sent, own-answer latencies, covered latencies, CPU seconds of this
    process and of ``server_pid`` during the run, the run's wall seconds): a step is
    *covered* by the first decision, arriving within ``timeout_s``, that answers it or a
    later step of its server (that decision folded its telemetry, and the plugin stops
    waiting for an older step's answer once a newer one arrives: ``DecisionAge``).
    """
    sent = [deque() for _ in names]  # (step, send time ns), oldest first, until answered
    latencies: list[int] = []
    covered: list[int] = []
    timeout_ns = timeout_s * 1e9

    def on_answer(i: int, answered: int, arrived: int) -> None:
        waiting = sent[i]
        while waiting and waiting[0][0] <= answered:
            step, sent_ns = waiting.popleft()
            if arrived - sent_ns <= timeout_ns:
                covered.append(arrived - sent_ns)
                if step == answered:
                    latencies.append(arrived - sent_ns)

    cpu0: list = []

    def on_start() -> None:
        cpu0.extend((time.process_time(), server_pid and process_cpu_s(server_pid)))

    ready.wait()
    sent_steps, wall = paced_clients(endpoint, names, seconds, rate_hz,
                                     lambda i, step, ns: sent[i].append((step, ns)), on_answer,
                                     on_start)
    cpu = (time.process_time() - cpu0[0],
           server_pid and process_cpu_s(server_pid) - cpu0[1])
    out.put((sent_steps, latencies, covered, cpu, wall))


def _echo_server(endpoint: str) -> None:
    """The floor: bare pyzmq ROUTER + msgpack, each telemetry answered at once (no
    validation, no features, no policy), with a decision frame of the same shape."""
    import msgpack
    import zmq

    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(endpoint)
    pack, unpack = msgpack.Packer(use_bin_type=True).pack, msgpack.unpackb
    seq = 0
    while True:
        identity, frame = sock.recv_multipart()
        message = unpack(frame)
        if message[1] == 2:  # TELEMETRY
            seq += 1
            sock.send_multipart([identity, pack(
                [1, 3, seq, message[4] + DECISION_LAG, "echo", 1, [1], [3]])])


def start_echo(endpoint: str):
    """The echo floor in a process of its own; returns it once its socket is bound."""
    process = mp.get_context("spawn").Process(target=_echo_server, args=(endpoint,),
                                              daemon=True)
    process.start()
    wait_for_socket(endpoint, process.is_alive)
    return process


def stop(process) -> None:
    """Stop a controller (Popen) or echo (Process) started here."""
    if isinstance(process, subprocess.Popen):
        process.kill()
        process.wait()
    else:
        process.kill()
        process.join()


def bench_rtt(server: str, policy: Path, clients: int, seconds: float, rate_hz: float,
              endpoint: str, timeout_s: float = 0.1) -> dict:
    """Round trips of ``clients`` servers at ``rate_hz`` against ``server`` ("serve" or
    "echo"). A step is answered when the decision answering its telemetry arrives within
    ``timeout_s`` (the plugin's default timeout; later answers it ignores). Latency of all
    steps counts an unanswered step as infinite."""
    process = start_controller(policy, endpoint) if server == "serve" else start_echo(endpoint)
    ctx = mp.get_context("spawn")
    queue, ready = ctx.Queue(), ctx.Barrier(1)
    try:
        proc = ctx.Process(target=_rtt_clients,
                           args=(endpoint, [f"c{i}" for i in range(clients)], seconds, rate_hz,
                                 timeout_s, queue, ready, process.pid))
        proc.start()
        sent, latencies, covered_ns, (client_cpu, server_cpu), wall = queue.get(
            timeout=seconds + 60)
        proc.join()
    finally:
        stop(process)
    answered = np.asarray(latencies, dtype=float) / 1e3
    covered = np.asarray(covered_ns, dtype=float) / 1e3
    every = np.concatenate([answered, np.full(max(sent - answered.size, 0), np.inf)])
    every_covered = np.concatenate([covered, np.full(max(sent - covered.size, 0), np.inf)])
    return {
        "server": server, "clients": clients, "rate_hz": rate_hz, "sent": sent,
        "answered": int(answered.size), "answered_fraction": answered.size / max(sent, 1),
        "answered_us": _pct(answered), "all_steps_us": _pct(every),
        "covered_fraction": covered.size / max(sent, 1), "covered_us": _pct(covered),
        "all_steps_covered_us": _pct(every_covered),
        # CPU cores busy during the run (1.0 = one core all the time): is the machine's
        # CPU (2 cores, shared) enough for both sides?
        "server_cpu_cores": server_cpu / wall, "client_cpu_cores": client_cpu / wall,
        "transport": endpoint.split(":", 1)[0],
    }


# -- (c) throughput ---------------------------------------------------------------------


def _flood_client(endpoint: str, prefix: str, streams: int, seconds: float, out) -> None:
    """``streams`` servers (one DEALER each: a connection may hold only a few streams),
    each with one telemetry message in flight: a new one as soon as its answer arrives."""
    import zmq

    from controller.wire import apply_socket_limits, pack_telemetry

    context = zmq.Context()
    poller = zmq.Poller()
    socks = []
    for _ in range(streams):
        sock = context.socket(zmq.DEALER)
        apply_socket_limits(sock)
        sock.connect(endpoint)
        poller.register(sock, zmq.POLLIN)
        socks.append(sock)
    accepted = bytes(np.random.default_rng(0).integers(0, 4, size=32).astype(np.int8))
    total = sum(accepted)
    steps = [0] * streams

    def send(i: int) -> None:
        steps[i] += 1
        socks[i].send(pack_telemetry(f"{prefix}{i}", 0, steps[i], 0.0, 32, 4, 32, 50_000,
                                     500_000, 0, 3, accepted, total, 0.012))

    time.sleep(0.5)
    for i in range(streams):
        send(i)
    index = {sock: i for i, sock in enumerate(socks)}
    received = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for sock, _ in poller.poll(100):
            while sock.get(zmq.EVENTS) & zmq.POLLIN:
                sock.recv(zmq.NOBLOCK)
                received += 1
                send(index[sock])
    out.put(received)


def bench_throughput(server: str, policy: Path, processes: int, streams: int, seconds: float,
                     endpoint: str) -> dict:
    """Decisions per second, and per CPU-second of the answering process, with
    ``processes * streams`` streams each keeping one telemetry message in flight."""
    process = start_controller(policy, endpoint) if server == "serve" else start_echo(endpoint)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    try:
        procs = [ctx.Process(target=_flood_client,
                             args=(endpoint, f"p{i}-", streams, seconds, queue))
                 for i in range(processes)]
        for p in procs:
            p.start()
        time.sleep(0.5)  # connected (the clients wait as long before sending)
        cpu0, wall0 = process_cpu_s(process.pid), time.perf_counter()
        received = sum(queue.get(timeout=seconds + 60) for _ in procs)
        cpu, wall = process_cpu_s(process.pid) - cpu0, time.perf_counter() - wall0
        for p in procs:
            p.join()
    finally:
        stop(process)
    return {"server": server, "decisions": received, "decisions_per_s": received / seconds,
            "decisions_per_cpu_s": received / max(cpu, 1e-9), "cpu_cores": cpu / wall,
            "streams": processes * streams, "client_processes": processes}


# -- (d) local decision mode -------------------------------------------------------------


def bench_local(policy: Path, seconds: float, rate_hz: float = 1000.0,
                timeout_s: float = 0.1) -> dict:
    """Telemetry to decision in the plugin's local mode: a step's telemetry is queued as
    the hooks queue it, and the time until the client's I/O thread has decided on it is
    taken by this (the scheduler's) thread, looking every 20 us with the GIL released."""
    from controller.wire import Hello
    from sglang_hooks.client import ControllerClient
    from sglang_hooks.local import LocalDecisions

    candidates = tuple(range(8))
    client = ControllerClient(None, Hello("local", 0, candidates), timeout_s,
                              local=LocalDecisions(str(policy), candidates))
    accepted = [int(a) for a in np.random.default_rng(0).integers(0, 4, size=32)]
    latencies, sent = [], 0
    try:
        period = 1.0 / rate_hz
        start = time.perf_counter()
        step, next_send = 0, start
        while time.perf_counter() < start + seconds:
            step += 1
            queued = time.perf_counter()
            client.send_telemetry(("local", 0, step, queued, 32, 4, 32, 50_000, 500_000, 0, 3,
                                   accepted, 0.012), step, time.monotonic())
            sent += 1
            next_send += period
            while time.perf_counter() < max(next_send, queued + timeout_s):
                current = client.current
                if (current is not None and not isinstance(current, str)
                        and current.apply_from_step == step + DECISION_LAG):
                    latencies.append((time.perf_counter() - queued) * 1e6)
                    break
                time.sleep(0.00002)
            time.sleep(max(0.0, next_send - time.perf_counter()))
        counters = dict(client.counters)
    finally:
        client.close()
    answered = np.asarray(latencies)
    return {"telemetry_to_decision_us": _pct(answered), "sent": sent,
            "answered_fraction": answered.size / max(sent, 1), "counters": counters}


# -- main -------------------------------------------------------------------------------

#: Per run: (name, where in the run's results, where the floor is, "ratio" or "value").
SUMMARY = (
    ("plugin CPU per step, source, added (us, p50)", ("hooks_us", "source", "added_cpu_p50"),
     ("hooks_us", "empty_hooks", "added_cpu_p50")),
    ("plugin CPU per step, source recording, added (us, p50)",
     ("hooks_us", "source_recording", "added_cpu_p50"),
     ("hooks_us", "empty_hooks", "added_cpu_p50")),
    ("plugin CPU per step, other rank, added (us, p50)",
     ("hooks_us", "other_rank", "added_cpu_p50"), ("hooks_us", "empty_hooks", "added_cpu_p50")),
    ("plugin CPU per step, source in local mode, added (us, p50)",
     ("hooks_us", "source_local", "added_cpu_p50"), ("hooks_us", "empty_hooks", "added_cpu_p50")),
    # The plugin's own clock against the four empty hooks on the same clock (the added
    # CPU of the empty hooks over the plain loop is within the noise, even below 0).
    ("plugin time per step, source, own clock (us, p50)",
     ("hooks_us", "source_clock", "p50_us"), ("hooks_us", "empty_clock", "p50_us")),
    ("plugin time per step, source, own clock (us, p99)",
     ("hooks_us", "source_clock", "p99_us"), ("hooks_us", "empty_clock", "p99_us")),
    ("round trip, 1 client x 1 kHz, answered (us, p50)", ("rtt_1", "serve", "answered_us", "p50"),
     ("rtt_1", "echo", "answered_us", "p50")),
    ("round trip, 8 clients x 1 kHz, answered (us, p50)", ("rtt_8", "serve", "answered_us", "p50"),
     ("rtt_8", "echo", "answered_us", "p50")),
    ("round trip, 8 clients x 1 kHz, answered (us, p99)",
     ("rtt_8", "serve", "answered_us", "p99"), ("rtt_8", "echo", "answered_us", "p99")),
    ("round trip, 8 clients x 1 kHz, all steps (us, p50)",
     ("rtt_8", "serve", "all_steps_us", "p50"), ("rtt_8", "echo", "all_steps_us", "p50")),
    ("steps answered, 8 clients x 1 kHz (fraction)", ("rtt_8", "serve", "answered_fraction"),
     ("rtt_8", "echo", "answered_fraction")),
    ("steps covered, 8 clients x 1 kHz (fraction)", ("rtt_8", "serve", "covered_fraction"),
     ("rtt_8", "echo", "covered_fraction")),
    ("round trip, 8 clients x 1 kHz, covered (us, p50)", ("rtt_8", "serve", "covered_us", "p50"),
     ("rtt_8", "echo", "covered_us", "p50")),
    ("CPU cores, 8 clients x 1 kHz: the answering process",
     ("rtt_8", "serve", "server_cpu_cores"), ("rtt_8", "echo", "server_cpu_cores")),
    ("CPU cores, 8 clients x 1 kHz: the client process",
     ("rtt_8", "serve", "client_cpu_cores"), ("rtt_8", "echo", "client_cpu_cores")),
    ("decisions per controller CPU-second", ("throughput", "serve", "decisions_per_cpu_s"),
     ("throughput", "echo", "decisions_per_cpu_s")),
    ("decisions per second (closed loop)", ("throughput", "serve", "decisions_per_s"),
     ("throughput", "echo", "decisions_per_s")),
    ("local mode: telemetry to decision (us, p50)", ("local", "telemetry_to_decision_us", "p50"),
     None),
)


def _get(tree: dict, path: tuple) -> float | None:
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return float(tree)


def one_run(args, workdir: Path, policy: Path) -> dict:
    """Every part once, each next to its floor measured in this run."""
    parts = args.only or ["hooks", "rtt", "local", "throughput"]
    endpoint = (lambda: f"ipc://{workdir}/b{next(_endpoints)}.sock") if args.transport == "ipc" \
        else (lambda: f"tcp://127.0.0.1:{free_port()}")
    run: dict = {"load_average_1min_before": os.getloadavg()[0]}
    if "hooks" in parts:
        run["hooks_us"] = bench_hooks(args.sglang, args.hook_iterations, workdir)
    if "rtt" in parts:
        for clients in (1, 8):
            run[f"rtt_{clients}"] = {
                server: bench_rtt(server, policy, clients, args.seconds, 1000.0, endpoint())
                for server in ("echo", "serve")}
    if "local" in parts:
        run["local"] = bench_local(policy, args.seconds)
    if "throughput" in parts:
        processes = 2
        run["throughput"] = {
            server: bench_throughput(server, policy, processes, 128 // processes, args.seconds,
                                     endpoint())
            for server in ("echo", "serve")}
    return run


_endpoints = iter(range(10**6))


def summarize(runs: list[dict]) -> dict:
    """Median over runs of each summary value, and of its ratio to the same run's floor."""
    out = {}
    for name, path, floor in SUMMARY:
        values = [v for v in (_get(r, path) for r in runs) if v is not None]
        if not values:
            continue
        entry = {"median": float(np.median(values)), "runs": values}
        if floor is not None:
            pairs = [(_get(r, path), _get(r, floor)) for r in runs]
            floors = [f for v, f in pairs if v is not None and f is not None]
            # A floor at or below 0 (an added cost within the noise) makes no ratio.
            ratios = [v / f for v, f in pairs if v is not None and f is not None and f > 0]
            if floors:
                entry["floor_median"] = float(np.median(floors))
            if ratios:
                entry["ratio_median"] = float(np.median(ratios))
                entry["ratios"] = ratios
        out[name] = entry
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=["hooks", "rtt", "throughput", "local"],
                        action="append")
    parser.add_argument("--runs", type=int, default=3, help="medians over this many runs")
    parser.add_argument("--sglang", type=Path, default=REPO / ".sglang" / "0.5.23")
    parser.add_argument("--hook-iterations", type=int, default=4000)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--transport", choices=["ipc", "tcp"], default="ipc")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_online.json")
    args = parser.parse_args()
    results: dict = {"cpu_count": os.cpu_count(), "python": sys.version.split()[0],
                     "transport": args.transport, "runs": []}
    # (ignore_cleanup_errors: a straggling writer thread must not cost the results)
    with tempfile.TemporaryDirectory(prefix="sc-bench-", ignore_cleanup_errors=True) as tmp:
        workdir = Path(tmp)
        policy = workdir / "bench-policy.npz"
        ExportedPolicy.random(seed=1).save(policy)
        for i in range(args.runs):
            print(f"run {i + 1}/{args.runs} ...", flush=True)
            results["runs"].append(one_run(args, workdir, policy))
    results["summary"] = summarize(results["runs"])
    print_table(results["summary"], args.runs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"\nwritten: {args.out}")


def print_table(summary: dict, runs: int) -> None:
    print(f"\nmedian of {runs} run(s); floor = the same measurement against the floor "
          "(four empty hooks / bare echo) in the same run")
    print(f"{'measurement':56s} {'specctl':>10s} {'floor':>10s} {'ratio':>7s}")
    for name, entry in summary.items():
        floor = entry.get("floor_median")
        ratio = entry.get("ratio_median")
        print(f"{name:56s} {entry['median']:10.3g} "
              f"{'' if floor is None else format(floor, '10.3g'):>10s} "
              f"{'' if ratio is None else format(ratio, '7.2f'):>7s}")


if __name__ == "__main__":
    main()
