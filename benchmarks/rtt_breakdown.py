"""Where a remote round trip's time goes: one telemetry -> decision, timestamped.

A diagnostic, not a test (docs/ONLINE.md, thirteenth pass). The clients of
``bench_online.py``'s round trip (the same loop: N servers stepping at 1 kHz on one
poller) send telemetry to ``specctl-serve`` or to the bare echo; both answering processes
here are the benchmark's own, with a timestamp taken at each point of a poll:

    client send -> answerer's wait returns -> frames read and decoded (``_drain``) ->
    decisions made (``decide``: folding, features, policy) -> its decision sent -> client
    receives

``time.perf_counter_ns`` is CLOCK_MONOTONIC on Linux, one clock for every process, so
the client's and the daemon's stamps subtract. The daemon is ``specctl-serve`` itself
(``controller.cli.main``, its config and process settings) with ``poll_once`` and
``_send`` replaced by copies that add the stamps (``perf_counter_ns``, ~60 ns each, and
the thread's CPU clock around the work). Reported per answered step, median (p90) over
the run, microseconds:

* ``queued``: the telemetry arrived while the answerer was still busy with an earlier
  poll (its wait began after the send);
* ``in``: from the send (or the wait's start, if later) to the wait's return: both
  processes' ZeroMQ I/O threads and the answerer's wake-up;
* ``read``, ``decide``, ``send``: the poll's own work up to this decision's send;
* ``out``: from that send to the client's poll returning with it;
* ``cpu``: the answerer's thread CPU for the poll's work (read to last send), and
  ``work_wall`` the wall time of the same span: where they differ the thread was off
  the CPU mid-poll.

Environment switches (the stamped daemon): ``RTT_FINE=1`` also times each of the poll's
main calls (decode, folding, grids, the MLP, the guard, ...; ~0.15 us a call), and the core
the daemon's thread waited and woke on; ``RTT_BATCH_AT=N`` sets ``controller.io_thread``'s
threshold (an A/B of the I/O thread's batch scheduling).

    python benchmarks/rtt_breakdown.py --clients 1 8 --seconds 5 --out runs/rtt_breakdown.json
"""

from __future__ import annotations

import argparse
import atexit
import itertools
import json
import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_online import (  # noqa: E402
    paced_clients,
    process_cpu_s,
    start_bound,
    wait_for_socket,
)

from controller.policy_file import ExportedPolicy  # noqa: E402
from controller.wire import DECISION_LAG  # noqa: E402

# -- the daemon, stamped ----------------------------------------------------------------------


def _stamped_daemon(out_path: str) -> None:
    """Patch ``ControllerServer`` with stamped copies of ``poll_once`` and ``_send``, run
    ``specctl-serve`` (``sys.argv`` holds its overrides), dump the stamps at exit."""
    import ctypes

    import zmq

    from controller import server as server_mod
    from controller.cli import main

    polls: list[tuple] = []
    clock, cpu = time.perf_counter_ns, time.thread_time_ns
    getcpu = ctypes.CDLL(None).sched_getcpu  # the core a poll ran on (vDSO, ~0.1 us)
    send_stamps: list[tuple[str, int, int]] = []
    backend_send, sndmore, noblock = (server_mod._BACKEND_SEND, server_mod._SNDMORE_NOBLOCK,
                                      server_mod._NOBLOCK)
    encode = server_mod.encode_decision

    def _send(self, decisions):  # ControllerServer._send, stamping each send
        sock, metrics = self._sock, self.metrics
        latencies = []
        for stream, decision in decisions:
            try:
                backend_send(sock, stream.identity, sndmore)
                backend_send(sock, encode(decision), noblock)
            except zmq.ZMQError:
                self.counters["send_failed"] += 1
                continue
            done = clock()
            send_stamps.append((stream.key[1], decision.apply_from_step - DECISION_LAG, done))
            latencies.append(done / 1e9 - stream.received)
        if latencies:
            metrics.latency.observe_many(latencies)
            metrics.decisions.inc(len(latencies))
        return len(latencies)

    def poll_once(self, timeout_ms: int = 50) -> int:  # ControllerServer.poll_once, stamped
        entered = clock()
        now = time.monotonic()
        if self.holder.poll(now) is False:
            self.metrics.reloads.labels(result="error").inc()
        if now >= self._next_sweep:
            self._sweep(now)
        if now >= self._next_log:
            self._log_summary(now)
        waiting = clock()
        core_before = getcpu()
        if not self._poller.poll(timeout_ms):
            return 0
        woke = clock()
        parts["core_before"], parts["core_after"] = core_before, getcpu()
        cpu0 = cpu()
        started = time.perf_counter()
        pending = self._drain()
        read = clock()
        decisions = self.decide(pending)
        decided = clock()
        del send_stamps[:]
        sent = self._send(decisions)
        done = clock()
        cpu1 = cpu()
        self._busy_s = time.perf_counter() - started
        self._io_policy.after_poll(sent)
        polls.append((entered, waiting, woke, read, decided, done, cpu1 - cpu0,
                      tuple(send_stamps), self._io_policy.batch, dict(parts)))
        parts.clear()
        return sent

    server_mod.ControllerServer._send = _send
    server_mod.ControllerServer.poll_once = poll_once
    if os.environ.get("RTT_BATCH_AT"):  # controller.io_thread's threshold, for an A/B
        import functools

        server_mod.IoThreadPolicy = functools.partial(
            server_mod.IoThreadPolicy, batch_at=int(os.environ["RTT_BATCH_AT"]))
    parts: dict[str, int] = {}
    if os.environ.get("RTT_FINE"):  # each named call's wall time per poll (~0.15 us a call)
        from daemon_parts import timed  # the same wrapper, here on the wall clock

        for name in ("decode", "evaluate", "probing_flags", "encode_decision"):
            timed(server_mod, name, parts, clock)
        from controller import decider, policy_file
        timed(decider, "apply_guard", parts, clock)
        timed(policy_file.ExportedPolicy, "logits", parts, clock)
        encode = server_mod.encode_decision
        for name in ("_handle_frames", "_fold", "_observation_grids", "_answer"):
            timed(server_mod.ControllerServer, name, parts, clock)

    def dump() -> None:
        with open(out_path, "wb") as f:
            pickle.dump(polls, f)

    atexit.register(dump)
    main()


def start_daemon(policy: Path, endpoint: str, out_path: Path) -> subprocess.Popen:
    """The stamped ``specctl-serve`` (the benchmark's overrides) in a process of its own."""
    return start_bound([sys.executable, str(Path(__file__).resolve()), "--daemon-out",
                        str(out_path), f"policy={policy}", f"endpoint={endpoint}",
                        "log_level=WARNING"],
                       endpoint, "stamped daemon", env={**os.environ, "PYTHONPATH": str(REPO)})


# -- the echo, stamped ------------------------------------------------------------------------


def _stamped_echo(endpoint: str, out_path: str) -> None:
    """``bench_online``'s echo (blocking ``recv_multipart``, answer at once), stamped;
    dumps the stamps on SIGTERM."""
    import signal

    import msgpack
    import zmq

    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(endpoint)
    pack, unpack = msgpack.Packer(use_bin_type=True).pack, msgpack.unpackb
    clock = time.perf_counter_ns
    polls: list[tuple] = []

    def dump(*_) -> None:
        with open(out_path, "wb") as f:
            pickle.dump(polls, f)
        os._exit(0)

    signal.signal(signal.SIGTERM, dump)
    seq = 0
    while True:
        waiting = clock()
        identity, frame = sock.recv_multipart()
        woke = clock()
        message = unpack(frame)
        read = clock()
        if message[1] == 2:  # TELEMETRY
            seq += 1
            reply = pack([1, 3, seq, message[4] + DECISION_LAG, "echo", 1, [1], [3]])
            decided = clock()
            sock.send_multipart([identity, reply])
            done = clock()
            polls.append((waiting, waiting, woke, read, decided, done, 0,
                          ((message[2], message[4], done),), False, {}))


# -- the clients ------------------------------------------------------------------------------


def _clients(endpoint: str, names: list[str], seconds: float, rate_hz: float, out,
             server_pid: int) -> None:
    """``bench_online.paced_clients``, recording (server, step, sent, received)."""
    sent_at: dict[tuple[int, int], int] = {}
    received: list[tuple[int, int, int, int]] = []
    cpu0: list = []

    def on_sent(i: int, step: int, sent_ns: int) -> None:
        sent_at[i, step] = sent_ns

    def on_answer(i: int, step: int, arrived: int) -> None:
        if (i, step) in sent_at:
            received.append((i, step, sent_at[i, step], arrived))

    def on_start() -> None:
        cpu0.extend((time.process_time(), process_cpu_s(server_pid)))

    sent, wall = paced_clients(endpoint, names, seconds, rate_hz, on_sent, on_answer, on_start)
    out.put((sent, received, time.process_time() - cpu0[0],
             process_cpu_s(server_pid) - cpu0[1], wall))


# -- one run ----------------------------------------------------------------------------------


def run_one(server: str, policy: Path, clients: int, seconds: float, workdir: Path,
            tag: str, rate_hz: float = 1000.0) -> dict:
    endpoint = f"ipc://{workdir}/{tag}.sock"
    stamps = workdir / f"{tag}.stamps"
    if server == "serve":
        process = start_daemon(policy, endpoint, stamps)
        pid = process.pid
    else:
        process = mp.get_context("spawn").Process(target=_stamped_echo,
                                                  args=(endpoint, str(stamps)), daemon=True)
        process.start()
        wait_for_socket(endpoint, process.is_alive)
        pid = process.pid
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    names = [f"c{i}" for i in range(clients)]
    proc = ctx.Process(target=_clients, args=(endpoint, names, seconds, rate_hz, queue, pid))
    proc.start()
    sent, received, client_cpu, server_cpu, wall = queue.get(timeout=seconds + 60)
    proc.join()
    os.kill(pid, 15)
    if server == "serve":
        process.wait(timeout=30)
    else:
        process.join(timeout=30)
    with open(stamps, "rb") as f:
        polls = pickle.load(f)
    return {"server": server, "clients": clients, "sent": sent,
            "server_cpu_cores": server_cpu / wall, "client_cpu_cores": client_cpu / wall,
            **breakdown(polls, received, names)}


def breakdown(polls: list[tuple], received: list[tuple], names: list[str]) -> dict:
    """Join the answerer's stamps with the client's by (server, step); the parts per step."""
    by_key = {}
    for entered, waiting, woke, read, decided, done, cpu_ns, sends, batch, _ in polls:
        for position, (name, step, sent_ns) in enumerate(sends):
            by_key[name, step] = (entered, waiting, woke, read, decided, sent_ns, done, cpu_ns,
                                  position, len(sends), batch)
    rows = []
    for i, step, t_send, t_recv in received:
        hit = by_key.get((names[i], step))
        if hit is None:
            continue
        entered, waiting, woke, read, decided, sent_ns, done, cpu_ns, position, n, batch = hit
        rows.append((t_recv - t_send, max(0, waiting - t_send), woke - max(waiting, t_send),
                     read - woke, decided - read, sent_ns - decided, t_recv - sent_ns,
                     cpu_ns, done - woke, n, batch, entered - t_send))
    a = np.asarray(rows, dtype=float)
    names_ = ["total", "queued", "in", "read", "decide", "send", "out", "cpu", "work_wall",
              "answers_in_poll"]
    out = {"n": len(rows)}
    for k, name in enumerate(names_):
        scale = 1.0 if name == "answers_in_poll" else 1e-3
        col = a[:, k] * scale
        out[name] = {"p50": float(np.median(col)), "p90": float(np.percentile(col, 90)),
                     "mean": float(col.mean())}
    out["queued_fraction"] = float((a[:, 1] > 0).mean())
    out["batch_fraction"] = float(a[:, 10].mean())
    for flag, label in ((1.0, "while_batch"), (0.0, "while_normal")):
        sel = a[a[:, 10] == flag]
        if len(sel):  # the I/O thread's scheduling (controller.io_thread) when answered
            out[label] = {"n": len(sel), "total_p50": float(np.median(sel[:, 0])) / 1e3,
                          "out_p50": float(np.median(sel[:, 6])) / 1e3}
    # Per poll (not per step): how long the answerer waited between polls, its CPU.
    p = np.asarray([(w[2] - w[1], w[6], w[5] - w[2]) for w in polls], dtype=float) / 1e3
    # From a poll's last send to the answerer's next wait: its thread's work after answering.
    after = [nxt[1] - cur[5] for cur, nxt in itertools.pairwise(polls)]
    out["after_send_us_p50"] = float(np.median(after)) / 1e3 if after else float("nan")
    answers = np.asarray([len(w[7]) for w in polls])
    counts = np.unique(answers, return_counts=True)
    out["polls_by_answers"] = {int(k): int(v) for k, v in zip(*counts, strict=True)}
    out["per_poll"] = {"polls": len(polls), "wait_us_p50": float(np.median(p[:, 0])),
                       "cpu_us_p50": float(np.median(p[:, 1])),
                       "work_wall_us_p50": float(np.median(p[:, 2]))}
    cores = [(w[9]["core_before"], w[9]["core_after"]) for w in polls if "core_before" in w[9]]
    if cores:
        out["moved_core_fraction"] = float(np.mean([a != b for a, b in cores]))
    fine = [w[9] for w in polls if len(w[7]) == 1 and w[9]]  # one-answer polls
    if fine:
        out["per_call_one_answer_polls_us_p50"] = {
            name: float(np.median([f.get(name, 0) for f in fine])) / 1e3 for name in fine[0]
            if not name.startswith("core_")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--runs", type=int, default=1)
    # Each client's step rate: above 1 kHz the answerer's polls come closer together
    # (its caches warmer), which tells the poll's cold cost from its work.
    parser.add_argument("--rate-hz", type=float, default=1000.0)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "rtt_breakdown.json")
    args = parser.parse_args()
    results = {"runs": []}
    with tempfile.TemporaryDirectory(prefix="sc-rtt-", ignore_cleanup_errors=True) as tmp:
        workdir = Path(tmp)
        policy = workdir / "bench-policy.npz"
        ExportedPolicy.random(seed=1).save(policy)
        k = 0
        for _ in range(args.runs):
            run = {"load_average_1min_before": os.getloadavg()[0]}
            for clients in args.clients:
                for server in ("echo", "serve"):
                    k += 1
                    run[f"{server}_{clients}"] = r = run_one(server, policy, clients,
                                                             args.seconds, workdir, f"r{k}",
                                                             args.rate_hz)
                    print(f"{server:5s} x{clients}: " + "  ".join(
                        f"{n} {r[n]['p50']:.0f}" for n in ("total", "queued", "in", "read",
                                                          "decide", "send", "out", "cpu",
                                                          "work_wall"))
                        + f"  answered {r['n']}/{r['sent']}  queued {r['queued_fraction']:.2f}"
                        f"  cores {r['server_cpu_cores']:.2f}", flush=True)
            results["runs"].append(run)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"written: {args.out}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--daemon-out":
        out = sys.argv[2]
        sys.argv = [sys.argv[0], *sys.argv[3:]]
        _stamped_daemon(out)
    else:
        main()
