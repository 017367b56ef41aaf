"""Where a one-stream poll's wall time goes after an idle millisecond, part by part.

The twenty-fourth pass's ad-hoc instrument (docs/ONLINE.md): one ``ControllerServer`` of
the tree given (the cost profile bench_online's daemon serves), one DEALER over inproc://;
each poll one telemetry frame, then 1 ms asleep and ``MIB`` MiB written (0: the sleep
alone), then ``_drain`` + ``decide`` + ``_send`` as ``poll_once`` runs them after its wait.
Each listed call is wrapped in ``time.perf_counter_ns`` (nested parts inside their
callers; each wrapper adds ~1.3 us cold). Prints the median per poll, the first 500 polls
left out.

    python docs/results/bench_online_pass24/cold_parts.py TREE [MIB] [STREAMS]
"""

from __future__ import annotations

import gc
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq


def main() -> None:
    tree = Path(sys.argv[1]).resolve()
    mib = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    streams = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    sys.path.insert(0, str(tree))
    from threadpoolctl import threadpool_limits

    threadpool_limits(1, user_api="blas")  # as specctl-serve
    import controller.decider as decider
    import controller.server as server_module
    import env.features as features
    from benchmarks.bench_online import telemetry
    from benchmarks.daemon_parts import timed as timed_by
    from controller.policy_file import ExportedPolicy
    from controller.reload import PolicyHolder
    from controller.streams import keep_freed_memory
    from env.sim.cost_model import load_profile

    keep_freed_memory()
    path = Path(tempfile.mkdtemp(prefix="sc-cold-")) / "policy.npz"
    ExportedPolicy.random(seed=1).save(path)
    server = server_module.ControllerServer(
        PolicyHolder(path), server_module.ServeOptions(endpoint="inproc://cold",
                                                       max_drain_s=10.0),
        cost_prior=load_profile("h200_llama31_8b"))
    spent: dict[str, int] = {}
    clock = time.perf_counter_ns

    def timed(obj: object, name: str) -> None:  # daemon_parts' wrapper, on the wall clock
        timed_by(obj, name, spent, clock)

    for name in ("_drain", "decide", "_send", "_fold", "_answer", "_observation_grids",
                 "_handle_connections", "_telemetry"):
        timed(server, name)
    for module, name in ((server_module, "evaluate"), (server_module, "decode_telemetry_fast"),
                         (server_module, "probing_flags"), (server_module, "encode_decision"),
                         (decider, "apply_guard"), (server_module, "observation_grids")):
        timed(module, name)
    timed(server.holder.policy, "logits")
    timed(server.streams, "get")
    timed(server.metrics.latency, "observe_many")
    timed(features.FeatureBuilder, "update")
    dealers = []
    for _ in range(streams):
        dealer = server._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(server.endpoint)
        dealers.append(dealer)
    buffer = np.zeros(mib * 2**20 // 8)
    gc.freeze()
    gc.set_threshold(10_000, *gc.get_threshold()[1:])  # as specctl-serve
    rows = []
    try:
        for k in range(2500):
            for i, dealer in enumerate(dealers):
                dealer.send(telemetry(f"s{i}", k + 1, 32))
            for dealer in dealers:  # the previous poll's answers
                while dealer.poll(0):
                    dealer.recv()
            time.sleep(0.001)
            buffer[::8] += 1.0
            spent.clear()
            started = clock()
            server._send(server.decide(server._drain()))
            spent["poll"] = clock() - started
            rows.append(dict(spent))
    finally:
        for dealer in dealers:
            dealer.close()
        server.close()
    rows = rows[500:]
    medians = {name: float(np.median([r.get(name, 0) for r in rows])) / 1e3 for name in rows[0]}
    for name, us in sorted(medians.items(), key=lambda item: -item[1]):
        print(f"{name:24s} {us:7.1f}")


if __name__ == "__main__":
    main()
