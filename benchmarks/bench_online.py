"""Online costs of specctl: hook cost per scheduler step, control round trip, controller throughput.

Not a test: run it, read the table, keep the JSON.

    python benchmarks/bench_online.py --out runs/bench_online.json

(a) ``hooks``: the scheduler-thread time the plugin adds per step. The stand-in
    scheduler of :mod:`sglang_hooks.testing` runs batches of 64 requests (a
    2-request prefill every 50 steps) in overlap order, once plain (SGLang's own
    ``AdaptiveSpeculativeParams``, no hooks) and once hooked (source rank with a
    live ``specctl-serve``; source rank also recording; a non-source rank). Each
    iteration (pull, broadcast as a pickle round trip, input processing, launch,
    result processing) is timed; steps are 1 ms apart so decisions arrive
    between them as on a real server. Needs SGLang (``--sglang``, default
    ``.sglang/0.5.23``).
(b) ``rtt``: 8 client processes, 1 kHz each, send telemetry to one
    ``specctl-serve`` over loopback TCP and time each decision's arrival.
(c) ``throughput``: client processes keep many streams' telemetry in flight
    (closed loop); decisions per second of one controller process.
"""

from __future__ import annotations

import argparse
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
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from controller.policy_file import ExportedPolicy  # noqa: E402
from controller.wire import DECISION_LAG, Decision, decode, encode_step  # noqa: E402
from env.schema import StepRecord  # noqa: E402


def percentiles(values_ns: list[float] | np.ndarray, scale: float = 1e-3) -> dict:
    v = np.asarray(values_ns, dtype=float) * scale
    return {"p50": float(np.percentile(v, 50)), "p99": float(np.percentile(v, 99)),
            "max": float(v.max()), "n": int(v.size)}


def start_controller(policy: Path, endpoint: str) -> subprocess.Popen:
    process = subprocess.Popen(
        [sys.executable, "-m", "controller.cli", f"policy={policy}", f"endpoint={endpoint}",
         "log_level=WARNING"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # log level WARNING: wait for the socket instead
        if endpoint.startswith("ipc://") and os.path.exists(endpoint[6:]):
            return process
        if endpoint.startswith("tcp://"):
            host, port = endpoint[6:].rsplit(":", 1)
            try:
                socket.create_connection((host, int(port)), timeout=0.2).close()
                return process
            except OSError:
                pass
        if process.poll() is not None:
            raise RuntimeError(f"specctl-serve exited: {process.stdout.read()}")
        time.sleep(0.05)
    raise RuntimeError("specctl-serve did not start")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def telemetry(server: str, step: int, batch: int = 32) -> bytes:
    accepted = np.random.default_rng(step).integers(0, 4, size=batch).astype(np.int8)
    return encode_step(StepRecord(server, 0, step, step * 0.01, batch, 4, batch, 50_000,
                                  500_000, 0, 3, accepted, 0.012))


# -- (a) hook cost ----------------------------------------------------------------------


def bench_hooks(sglang_path: Path, iterations: int, workdir: Path) -> dict:
    from sglang_hooks.testing import write_import_stand_ins

    stand_ins = workdir / "stand-ins"
    write_import_stand_ins(stand_ins)
    sys.path[1:1] = [str(sglang_path), str(stand_ins)]
    from sglang.srt.speculative import adaptive_runtime_state as ars
    from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams

    from sglang_hooks import adaptive_config_path
    from sglang_hooks.compat import Ranks, installed_version
    from sglang_hooks.config import PluginConfig
    from sglang_hooks.policy import make_policy_class
    from sglang_hooks.runtime import Runtime
    from sglang_hooks.testing import (
        DECODE,
        EXTEND,
        BatchStandIn,
        RankLoop,
        ReceiverStandIn,
        ReqStandIn,
        SchedulerStandIn,
        WorkerStandIn,
        hooked_classes,
    )

    config = str(adaptive_config_path())
    base = {"cls": AdaptiveSpeculativeParams}
    version = installed_version()

    def acceptance(step: int, steps: int, batch: int) -> list[int]:
        return [min(steps, (step * 7 + i) % 5) for i in range(batch)]

    def build(rt: Runtime | None, is_source: bool) -> RankLoop:
        worker = WorkerStandIn(3, ars.SpecRuntimeState)
        params_class = base["cls"] if rt is None else make_policy_class(base["cls"], rt)
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

    def measure(loops: dict[str, RankLoop]) -> dict[str, list[int]]:
        """Run the loops in lock-step (one iteration each, in turn) so that drift in the
        machine's load hits all of them alike."""
        reqs = [ReqStandIn(f"r{i}") for i in range(64)]
        times = {name: ([], []) for name in loops}  # (wall, thread CPU) per iteration
        for i in range(iterations):
            for name, loop in loops.items():
                batch = (BatchStandIn(reqs[:2], EXTEND, extend_num_tokens=1024) if i % 50 == 7
                         else BatchStandIn(reqs, DECODE))
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
        "source_recording": Runtime(
            PluginConfig(server="b", controller=endpoint, record_dir=str(workdir / "rec")),
            version, ranks=Ranks(0, 2, 0, 1, 0, False)),
        "other_rank": Runtime(PluginConfig(server="c", controller=endpoint), version,
                              ranks=Ranks(1, 2, 0, 1, 0, False)),
    }
    try:
        loops = {"plain": build(None, True)}
        loops.update({name: build(rt, name != "other_rank") for name, rt in runtimes.items()})
        times = measure(loops)
    finally:
        controller.kill()
        counters = {name: {**rt.counters, **(rt.client.counters if rt.client else {})}
                    for name, rt in runtimes.items()}
        for rt in runtimes.values():
            rt.close()
    plain_wall, plain_cpu = times["plain"]
    results = {"plain": {**percentiles(plain_wall), "cpu": percentiles(plain_cpu)}}
    for name in runtimes:
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
            "counters": counters[name],
        }
    return results


# -- (b) round trip ---------------------------------------------------------------------


def _rtt_client(endpoint: str, name: str, seconds: float, rate_hz: float, out) -> None:
    import zmq

    sock = zmq.Context().socket(zmq.DEALER)
    sock.connect(endpoint)
    time.sleep(0.3)
    sent: dict[int, int] = {}
    latencies, period = [], 1.0 / rate_hz
    step, next_send, end = 0, time.perf_counter(), time.perf_counter() + seconds
    while time.perf_counter() < end:
        if time.perf_counter() >= next_send:
            step += 1
            sent[step] = time.perf_counter_ns()
            sock.send(telemetry(name, step))
            next_send += period
        # Block (never spin: 8 clients share the controller's cores) until a decision
        # arrives or the next send is due, rounded up to the poll's millisecond.
        wait_ms = max(0.0, (next_send - time.perf_counter()) * 1e3)
        if sock.poll(math.ceil(wait_ms)):
            arrived = time.perf_counter_ns()
            decision = decode(sock.recv())
            answered = decision.apply_from_step - DECISION_LAG
            if answered in sent:
                latencies.append(arrived - sent.pop(answered))
    out.put((step, latencies))


def _echo_server(endpoint: str) -> None:
    """A floor for the round trip: decode telemetry, answer at once, no features, no policy."""
    import zmq

    from controller.wire import encode_decision

    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(endpoint)
    while True:
        identity, frame = sock.recv_multipart()
        record = decode(frame)
        if isinstance(record, StepRecord):
            decision = Decision(0, record.step_index + DECISION_LAG, "echo", (1,), (3,))
            sock.send_multipart([identity, encode_decision(decision)])


def bench_rtt(policy: Path | None, clients: int, seconds: float, rate_hz: float) -> dict:
    """Round trips against specctl-serve (``policy``), or the echo floor (None)."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    if policy is None:
        controller = ctx.Process(target=_echo_server, args=(endpoint,), daemon=True)
        controller.start()
        time.sleep(1.0)
    else:
        controller = start_controller(policy, endpoint)
    queue = ctx.Queue()
    try:
        procs = [ctx.Process(target=_rtt_client,
                             args=(endpoint, f"c{i}", seconds, rate_hz, queue))
                 for i in range(clients)]
        for p in procs:
            p.start()
        results = [queue.get(timeout=seconds + 60) for _ in procs]
        for p in procs:
            p.join()
    finally:
        controller.kill()
    sent = sum(r[0] for r in results)
    latencies = [lat for r in results for lat in r[1]]
    return {**percentiles(latencies), "sent": sent, "answered": len(latencies),
            "clients": clients, "rate_hz": rate_hz, "transport": "tcp loopback"}


# -- (c) throughput ---------------------------------------------------------------------


def _flood_client(endpoint: str, prefix: str, streams: int, seconds: float, out) -> None:
    import zmq

    sock = zmq.Context().socket(zmq.DEALER)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.connect(endpoint)
    time.sleep(0.3)
    steps = [0] * streams
    for i in range(streams):  # one record per stream in flight
        steps[i] += 1
        sock.send(telemetry(f"{prefix}{i}", steps[i]))
    received, turn = 0, 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        if not sock.poll(100):
            continue
        decision = decode(sock.recv())
        assert isinstance(decision, Decision)
        received += 1
        turn = (turn + 1) % streams
        steps[turn] += 1
        sock.send(telemetry(f"{prefix}{turn}", steps[turn]))
    out.put(received)


def bench_throughput(policy: Path, processes: int, streams: int, seconds: float) -> dict:
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    controller = start_controller(policy, endpoint)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    try:
        procs = [ctx.Process(target=_flood_client,
                             args=(endpoint, f"p{i}-", streams, seconds, queue))
                 for i in range(processes)]
        for p in procs:
            p.start()
        received = sum(queue.get(timeout=seconds + 60) for _ in procs)
        for p in procs:
            p.join()
    finally:
        controller.kill()
    return {"decisions_per_s": received / seconds, "decisions": received,
            "streams": processes * streams, "client_processes": processes, "seconds": seconds}


# -- main -------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=["hooks", "rtt", "throughput"], action="append")
    parser.add_argument("--sglang", type=Path, default=REPO / ".sglang" / "0.5.23")
    parser.add_argument("--hook-iterations", type=int, default=5000)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_online.json")
    args = parser.parse_args()
    parts = args.only or ["hooks", "rtt", "throughput"]
    results: dict = {"cpu_count": os.cpu_count(), "python": sys.version.split()[0]}
    with tempfile.TemporaryDirectory(prefix="sc-bench-") as tmp:
        workdir = Path(tmp)
        policy = workdir / "bench-policy.npz"
        ExportedPolicy.random(seed=1).save(policy)
        if "hooks" in parts:
            results["hooks_us"] = bench_hooks(args.sglang, args.hook_iterations, workdir)
        if "rtt" in parts:
            results["rtt_1_client_us"] = bench_rtt(policy, clients=1, seconds=args.seconds,
                                                   rate_hz=1000)
            results["rtt_us"] = bench_rtt(policy, clients=8, seconds=args.seconds, rate_hz=1000)
            results["rtt_echo_floor_us"] = bench_rtt(None, clients=8, seconds=args.seconds,
                                                     rate_hz=1000)
        if "throughput" in parts:
            processes = max(2, min(4, (os.cpu_count() or 2) // 4))
            results["throughput"] = bench_throughput(policy, processes=processes,
                                                     streams=256 // processes,
                                                     seconds=args.seconds)
    print_table(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"\nwritten: {args.out}")


def print_table(results: dict) -> None:
    print(f"\n{'measurement':48s} {'p50':>9s} {'p99':>9s} {'max':>9s}")
    for name, r in results.get("hooks_us", {}).items():
        print(f"{'step, ' + name + ', wall (us)':48s} {r['p50']:9.1f} {r['p99']:9.1f} "
              f"{r['max']:9.1f}")
        print(f"{'step, ' + name + ', thread CPU (us)':48s} {r['cpu']['p50']:9.1f} "
              f"{r['cpu']['p99']:9.1f} {r['cpu']['max']:9.1f}")
        if "added_p50" in r:
            print(f"{'  added by the plugin, wall (us)':48s} {r['added_p50']:9.1f} "
                  f"{r['added_p99']:9.1f}")
            print(f"{'  added by the plugin, thread CPU (us)':48s} {r['added_cpu_p50']:9.1f} "
                  f"{r['added_cpu_p99']:9.1f}")
    for key, label in (("rtt_1_client_us", "round trip, 1 client x 1 kHz (us)"),
                       ("rtt_us", "round trip, 8 clients x 1 kHz (us)"),
                       ("rtt_echo_floor_us", "  same against an echo server (us)")):
        if key in results:
            r = results[key]
            print(f"{label:48s} {r['p50']:9.1f} {r['p99']:9.1f} {r['max']:9.1f}"
                  f"   answered {r['answered']}/{r['sent']}")
    if "throughput" in results:
        r = results["throughput"]
        print(f"{'controller throughput (decisions/s)':48s} {r['decisions_per_s']:9.0f}"
              f"   ({r['streams']} streams in flight)")


if __name__ == "__main__":
    main()
