"""Where a decision's time goes: micro-timings of the controller's parts, and a cProfile of
``specctl-serve`` answering one client at 1 kHz (``--load rtt``) or 128 closed-loop streams
(``--load flood``, as bench_online's throughput part). A diagnostic, not a test.

    python benchmarks/profile_controller.py [--seconds 4] [--load flood]
"""

from __future__ import annotations

import argparse
import cProfile
import multiprocessing as mp
import pstats
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_online import _flood_client, _rtt_clients, free_port, telemetry  # noqa: E402
from controller.policy_file import ExportedPolicy  # noqa: E402
from controller.reload import PolicyHolder  # noqa: E402
from controller.server import ControllerServer, ServeOptions  # noqa: E402
from controller.wire import Decision, decode, encode_decision  # noqa: E402
from env.features import FeatureBuilder  # noqa: E402


def per_call_us(fn, n: int = 2000) -> float:
    started = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - started) / n * 1e6


def micro(policy: ExportedPolicy) -> dict:
    frame = telemetry("s", 1, batch=64)
    record = decode(frame)
    builder = FeatureBuilder(policy.feature_spec)
    for _ in range(200):
        builder.update(record)
    grid = builder.observation_grid()
    decision = Decision(1, 3, "p", (1,), (3,))
    return {
        "decode_telemetry": per_call_us(lambda: decode(frame)),
        "features_update": per_call_us(lambda: builder.update(record)),
        "features_update_then_grid": per_call_us(
            lambda: (builder.update(record), builder.observation_grid())),
        "policy_logits_one_grid": per_call_us(lambda: policy.logits(grid)),
        "encode_decision": per_call_us(lambda: encode_decision(decision)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--load", choices=["rtt", "flood"], default="rtt")
    parser.add_argument("--clients", type=int, default=1, help="servers of the rtt load")
    parser.add_argument("--top", type=int, default=14, help="functions listed")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="sc-prof-") as tmp:
        path = Path(tmp) / "policy.npz"
        ExportedPolicy.random(seed=1).save(path)
        policy = ExportedPolicy.load(path)
        for name, us in micro(policy).items():
            print(f"{name:32s} {us:8.1f} us")
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        server = ControllerServer(PolicyHolder(path), ServeOptions(endpoint=endpoint))
        stop = threading.Event()
        profile = cProfile.Profile()
        thread = threading.Thread(target=lambda: profile.runcall(server.run, stop, 50))
        thread.start()
        ctx = mp.get_context("spawn")
        queue, ready = ctx.Queue(), ctx.Barrier(1)  # referenced here until the clients run
        if args.load == "flood":
            clients = [ctx.Process(target=_flood_client,
                                   args=(endpoint, f"p{i}-", 64, args.seconds, queue))
                       for i in range(2)]
        else:
            clients = [ctx.Process(target=_rtt_clients,
                                   args=(endpoint, [f"c{i}" for i in range(args.clients)],
                                         args.seconds, 1000, 0.1, queue, ready))]
        for client in clients:
            client.start()
        results = [queue.get(timeout=args.seconds + 60) for _ in clients]
        for client in clients:
            client.join()
        stop.set()
        thread.join()
        server.close()
        if args.load == "flood":
            print(f"decisions: {sum(results)} in {args.seconds} s")
        else:
            sent, latencies = results[0][:2]
            value = server.metrics.registry.get_sample_value
            print(f"round trip p50 {np.percentile(latencies, 50) / 1e3:.0f} us, "
                  f"answered {len(latencies)}/{sent}; decisions "
                  f"{value('specctl_decisions_total'):.0f}, "
                  f"frames shed {value('specctl_frames_shed_total'):.0f}")
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
