"""Load test: 32 well-behaved servers at 1 kHz plus one hostile client at full speed
against one ``specctl-serve``. A benchmark, not a test: run it, read the table.

    python benchmarks/load_daemon.py [--servers 32] [--rate-hz 1000] [--seconds 10]
                                     [--processes 4] [--no-hostile] [--out runs/load.json]

Each well-behaved server is a DEALER socket sending the plugin's telemetry frames every
step. A step "got a decision" when the latest decision it accepted answers telemetry
sent at most ``--timeout-ms`` (the plugin's default, 100 ms) before the step: the
plugin's rule for when the controller, not its fallback, sets the depth. Steps of the
first ``--warmup`` seconds (connecting, HELLO) are not counted. (All servers of a
process share one poller: the plugin's client thread per server would measure this
machine's GIL contention, not the daemon.)

The hostile client sends, as fast as one process can, a rotation of: telemetry under
a new server name each time (stream churn), HELLOs with empty ``candidate_steps`` and
telemetry that claim the well-behaved servers' names and ranks (spoofing), out-of-range
telemetry (latency 1e308, batch 10**10), a 1,010-deep nested array and random bytes.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_online import (  # noqa: E402
    connect_servers,
    process_cpu_s,
    start_controller,
)
from controller.default_policy import default_policy_path  # noqa: E402


def _good_servers(endpoint: str, names: list[str], seconds: float, warmup_s: float,
                  rate_hz: float, timeout_s: float, out, ready) -> None:
    """Run ``names`` as servers stepping at ``rate_hz`` (one DEALER each, one poller for all:
    the plugin's I/O thread per server would measure this process's GIL, not the daemon).

    A step is covered when the latest decision the server accepted answers telemetry sent
    at most ``timeout_s`` before (the plugin's rule: it ignores older answers and falls
    back once its oldest unanswered telemetry is older than that).
    """
    import zmq

    from controller.wire import (
        DECISION_LAG,
        decode,
        pack_telemetry,
    )

    context, poller, socks, index = connect_servers(endpoint, names, "load")
    sent_at = [dict() for _ in names]  # step -> send time, pruned as answers arrive
    fresh = [-1.0] * len(names)  # send time of the telemetry the latest accepted answer answers
    counts = {name: {"steps": 0, "covered": 0, "stale_answers": 0, "send_dropped": 0}
              for name in names}
    rng = np.random.default_rng(len(names))
    period = 1.0 / rate_hz
    ready.wait()  # every process imported and connected: start together
    start = time.monotonic()
    next_step, end, step = start, start + seconds, 0
    while (now := time.monotonic()) < end:
        for sock, _ in poller.poll(max(0.0, (next_step - now) * 1e3)):
            i = index[sock]
            while sock.poll(0):
                answered = decode(sock.recv()).apply_from_step - DECISION_LAG
                t = sent_at[i].get(answered)
                arrived = time.monotonic()
                if t is None or arrived - t > timeout_s:
                    counts[names[i]]["stale_answers"] += 1
                elif t > fresh[i]:
                    fresh[i] = t
                for old in [k for k in sent_at[i] if k <= answered]:
                    del sent_at[i][old]
        now = time.monotonic()
        if now < next_step:
            continue
        next_step += period
        step += 1
        counted = now - start >= warmup_s
        for i, (name, sock) in enumerate(zip(names, socks, strict=True)):
            batch = int(rng.integers(1, 64))
            accepted = bytes(rng.integers(0, 4, size=batch).astype(np.uint8))
            frame = pack_telemetry(name, 0, step, now, batch, 4, batch, 50_000, 500_000, 0, 3,
                                   accepted, sum(accepted), 0.012)
            c = counts[name]
            try:
                sock.send(frame, zmq.NOBLOCK)
                sent_at[i][step] = now
            except zmq.Again:
                c["send_dropped"] += counted
            if counted:
                c["steps"] += 1
                c["covered"] += now - fresh[i] <= timeout_s
    for sock in socks:
        sock.close(0)
    context.term()
    out.put(counts)


def _hostile(endpoint: str, victims: list[str], seconds: float, out, ready) -> None:
    """Send hostile frames as fast as possible; put how many were sent."""
    import msgpack
    import zmq

    from controller.wire import Hello, encode_hello, pack_telemetry

    sock = zmq.Context().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.connect(endpoint)
    rng = np.random.default_rng(1)
    fixed = [
        pack_telemetry("x", 0, 1, 0.5, 10**10, 0, 1, 10, 100, 0, 0, b"", 0, 0.01),
        pack_telemetry("x", 0, 1, 0.5, 8, 0, 1, 10, 100, 0, 0, b"", 0, 1e308),
        b"\x91" * 1010 + b"\xc0",
        msgpack.packb([1, 2, "x", "rank"]),
    ]
    sent = dropped = i = 0
    ready.wait()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        i += 1
        kind = i % 6
        victim = victims[i % len(victims)]
        if kind == 0:  # churn: a new name every time
            frame = pack_telemetry(f"churn-{i}", 0, 1, 0.5, 8, 0, 8, 10, 100, 0, 3,
                                   bytes([1] * 8), 8, 0.01)
        elif kind == 1:  # spoofed HELLO: "this server can run no step"
            frame = encode_hello(Hello(victim, 0, ()))
        elif kind == 2:  # spoofed telemetry: a restart and a slow step
            frame = pack_telemetry(victim, 0, i % 3, 0.5, 1000, 4000, 1000, 10, 100, 0, 7,
                                   bytes([0] * 16), 0, 30.0)
        elif kind == 3:
            frame = fixed[i % len(fixed)]
        else:
            frame = rng.bytes(int(rng.integers(1, 64)))
        try:
            sock.send(frame, zmq.NOBLOCK)
            sent += 1
        except zmq.Again:
            dropped += 1
    sock.close()
    out.put({"hostile_sent": sent, "hostile_dropped_at_sender": dropped})


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run(servers: int, rate_hz: float, seconds: float, warmup_s: float, processes: int,
        hostile: bool, timeout_s: float = 0.1, controller_nice: int = 0,
        pin: bool = False) -> dict:
    """One load run; returns the per-server coverage summary.

    ``controller_nice`` (negative: needs root) and ``pin`` (the controller alone on CPU 0,
    the load generators on the others) stand in for a controller with a core of its own
    on a machine shared with the load generators.
    """
    endpoint = f"ipc://{tempfile.mkdtemp(prefix='sl-')}/serve.sock"
    controller = start_controller(default_policy_path(), endpoint)
    if controller_nice:
        os.setpriority(os.PRIO_PROCESS, controller.pid, controller_nice)
    cpus = sorted(os.sched_getaffinity(0))
    if pin and len(cpus) > 1:
        for task in os.listdir(f"/proc/{controller.pid}/task"):  # every thread
            os.sched_setaffinity(int(task), {cpus[0]})
    names = [f"good-{i}" for i in range(servers)]
    context = mp.get_context("spawn")
    out = context.Queue()
    ready = context.Barrier(processes + hostile)
    workers = [context.Process(target=_good_servers,
                               args=(endpoint, names[p::processes], seconds, warmup_s, rate_hz,
                                     timeout_s, out, ready)) for p in range(processes)]
    if hostile:
        workers.append(context.Process(target=_hostile,
                                       args=(endpoint, names, seconds, out, ready)))
    try:
        for worker in workers:
            worker.start()
            if pin and len(cpus) > 1:
                os.sched_setaffinity(worker.pid, set(cpus[1:]))
        cpu0, wall0 = process_cpu_s(controller.pid), time.monotonic()
        results = [out.get(timeout=seconds + 120) for _ in workers]
        cpu = (process_cpu_s(controller.pid) - cpu0) / (time.monotonic() - wall0)
        for worker in workers:
            worker.join()
        rss = _rss_mb(controller.pid)
    finally:
        controller.terminate()
        log = controller.communicate(timeout=10)[0]
    if controller.returncode not in (0, -15):
        raise RuntimeError(f"specctl-serve exited with {controller.returncode}:\n{log}")
    counts: dict = {}
    extra: dict = {}
    for result in results:
        (extra if "hostile_sent" in result else counts).update(result)
    fractions = [c["covered"] / max(c["steps"], 1) for c in counts.values()]
    return {
        "servers": servers, "rate_hz": rate_hz, "seconds": seconds, "hostile": hostile,
        "controller_nice": controller_nice, "pinned": pin,
        "steps": sum(c["steps"] for c in counts.values()),
        "steps_per_server_per_s": float(np.mean([c["steps"] for c in counts.values()]))
        / (seconds - warmup_s),
        "decision_fraction_min": min(fractions),
        "decision_fraction_mean": float(np.mean(fractions)),
        "stale_answers": sum(c["stale_answers"] for c in counts.values()),
        "telemetry_dropped_at_sender": sum(c["send_dropped"] for c in counts.values()),
        "controller_rss_mb": rss,
        # 1.0 = one core busy all the time (includes the workers' start-up)
        "controller_cpu_cores": cpu,
        "load_average_1min": os.getloadavg()[0], **extra,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", type=int, default=32)
    parser.add_argument("--rate-hz", type=float, default=1000.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--timeout-ms", type=float, default=100.0)
    parser.add_argument("--no-hostile", action="store_true")
    parser.add_argument("--controller-nice", type=int, default=0)
    parser.add_argument("--pin", action="store_true",
                        help="controller alone on the first CPU, load generators on the rest")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    # Checked before anything starts: a run no longer than its warm-up counts nothing
    # (it ended in a ZeroDivisionError after the whole run).
    if args.warmup < 0 or args.seconds <= args.warmup:
        parser.error(f"--seconds ({args.seconds:g}) must be longer than --warmup "
                     f"({args.warmup:g}, >= 0): the first --warmup seconds are not counted")
    for name in ("servers", "rate_hz", "processes", "timeout_ms"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name):g}")
    result = run(args.servers, args.rate_hz, args.seconds, args.warmup, args.processes,
                 not args.no_hostile, args.timeout_ms / 1e3, args.controller_nice, args.pin)
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
