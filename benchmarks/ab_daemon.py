"""Lock-step A/B of the daemon's per-poll work: two source trees in one process.

A diagnostic, not a test. On this shared 2-core machine single benchmark runs move by
more than a few percent with the other engineers' load; two servers measured poll by
poll, in alternating order, in one process, see the same load.

    python benchmarks/ab_daemon.py --before /path/to/other/checkout [--streams 1 5 64]
        [--policy controller/data/default_policy.npz]

Each tree's ``controller`` and ``env`` packages are imported as their own copies (the
module table is swapped to a tree's copies while its server runs: the feature builder
imports its compiled backend lazily). Per poll, both servers take the same telemetry
frames (``handle_frame``, one frame per stream) and answer them (``decide``), each timed
in thread CPU; the daemon's process settings (one BLAS thread, ``keep_freed_memory``,
the garbage collector's) apply to both. Every 97th poll's decisions must be equal.

``--socket``: the frames go through each server's own socket instead (a DEALER per
stream, inproc:// in the server's context, so the whole poll's frames are queued before
it) and the poll read is ``_drain`` + ``decide`` + ``_send``, as ``poll_once`` does after
its wait. ``--cold``: before each timed poll the process sleeps 1 ms and writes a 32 MiB
buffer (what the clients, ZeroMQ's threads and an idle core do to the daemon's caches
between a 1-kHz server's polls; docs/ONLINE.md, thirteenth pass); still thread CPU (a
cache miss stalls the thread on the CPU; the sleep and the writing are not timed).
``--cold-mib N`` writes N MiB instead: at 4 a one-stream poll takes about what the real
daemon's does at one client x 1 kHz (150-240 us; twenty-fourth pass), where 32 MiB
makes it twice that.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
from source_trees import load_tree

REPO = Path(__file__).resolve().parents[1]
#: What each tree imports (``source_trees.load_tree``).
DAEMON_MODULES = ("controller.server", "controller.policy_file", "controller.reload",
                  "controller.streams", "env.features_compiled", "env.sim.cost_model",
                  "benchmarks.bench_online")


def measure(trees: dict[str, Path], streams: int, polls: int, through_socket: bool = False,
            cold: bool = False, policy: Path | None = None,
            profile: str | None = None, cold_mib: int = 32) -> dict[str, np.ndarray]:
    """Thread CPU (us) of each tree's handle_frame + decide per poll, lock-step (see the
    module's docstring for ``through_socket`` and ``cold``); both trees serve ``policy``
    (default: a random one, which has no off probe) with the cost profile ``profile``
    (each tree's ``load_profile``; None: telemetry only)."""
    tmp = Path(tempfile.mkdtemp(prefix="sc-ab-"))
    servers, modules = {}, {}
    for tag, root in trees.items():
        mods = modules[tag] = load_tree(root, DAEMON_MODULES)
        server_mod = mods["controller.server"]
        path = tmp / f"{tag}.npz"
        if policy is None:
            mods["controller.policy_file"].ExportedPolicy.random(seed=1).save(path)
        else:
            path.write_bytes(policy.read_bytes())
        mods["controller.streams"].keep_freed_memory()
        endpoint = f"inproc://ab-{tag}" if through_socket else f"ipc://{tmp}/{tag}.sock"
        prior = (None if profile is None
                 else mods["env.sim.cost_model"].load_profile(profile))
        servers[tag] = server_mod.ControllerServer(
            mods["controller.reload"].PolicyHolder(path),
            server_mod.ServeOptions(endpoint=endpoint, max_drain_s=10.0), cost_prior=prior)
    telemetry = modules["after"]["benchmarks.bench_online"].telemetry  # frames for both
    peers = [(b"peer%d" % i, "") for i in range(streams)]
    frames = [[telemetry(f"s{i}", k + 1, 32) for i in range(streams)] for k in range(polls)]
    dealers: dict[str, list] = {}
    if through_socket:
        import zmq

        for tag, server in servers.items():
            dealers[tag] = []
            for _ in range(streams):
                dealer = server._context.socket(zmq.DEALER)
                dealer.setsockopt(zmq.LINGER, 0)
                dealer.connect(server.endpoint)
                dealers[tag].append(dealer)
    buffer = np.zeros(cold_mib * 2**20 // 8) if cold else None
    gc.freeze()
    gc.set_threshold(10_000, *gc.get_threshold()[1:])  # as specctl-serve
    spent: dict[str, list[int]] = {tag: [] for tag in trees}
    seen: dict[str, list] = {tag: [] for tag in trees}
    clock = time.thread_time_ns
    order = list(trees)
    try:
        for k in range(polls):
            for tag in (order if k % 2 == 0 else order[::-1]):
                sys.modules.update(modules[tag])
                server, pending = servers[tag], {}
                if through_socket:
                    for dealer, frame in zip(dealers[tag], frames[k], strict=True):
                        dealer.send(frame)
                    # drain what answers the previous poll sent
                    for dealer in dealers[tag]:
                        while dealer.poll(0):
                            dealer.recv()
                if cold:
                    time.sleep(0.001)
                    buffer[::8] += 1.0  # every cache line of the buffer
                started = clock()
                if through_socket:
                    out = server.decide(server._drain())
                    server._send(out)
                else:
                    for peer, frame in zip(peers, frames[k], strict=True):
                        server.handle_frame(peer, frame, pending, 0.0)
                    out = server.decide(pending)
                spent[tag].append(clock() - started)
                if k % 97 == 0:
                    seen[tag].append([(d.seq, d.apply_from_step, d.batch_grid, d.steps)
                                      for _, d in out])
    finally:
        for socks in dealers.values():
            for dealer in socks:
                dealer.close()
        for server in servers.values():
            server.close()
    if seen["before"] != seen["after"]:
        raise SystemExit("the two trees' decisions differ")
    return {tag: np.asarray(v[polls // 5:]) / 1e3 for tag, v in spent.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="the other source tree")
    parser.add_argument("--after", type=Path, default=REPO)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 5, 64])
    parser.add_argument("--polls", type=int, default=2000)
    parser.add_argument("--socket", action="store_true",
                        help="frames through each server's socket: _drain + decide + _send")
    parser.add_argument("--cold", action="store_true",
                        help="1 ms asleep and 32 MiB written before each poll")
    parser.add_argument("--cold-mib", type=int, default=32,
                        help="the buffer --cold writes, MiB")
    parser.add_argument("--policy", type=Path,
                        help="the policy file both serve (default: a random one; the shipped "
                             "controller/data/default_policy.npz has the off probe on)")
    parser.add_argument("--profile", help="the cost profile both serve (bench_online's "
                        "specctl-serve: configs/serve.yaml's, h200_llama31_8b; default none)")
    args = parser.parse_args()
    # each tree's env package registers the same gymnasium env id: expected here
    warnings.filterwarnings("ignore", message=".*Overriding environment")
    from threadpoolctl import threadpool_limits

    threadpool_limits(1, user_api="blas")
    for n in args.streams:
        us = measure({"before": args.before.resolve(), "after": args.after.resolve()},
                     n, args.polls, args.socket, args.cold, args.policy, args.profile,
                     args.cold_mib)
        before, after = np.median(us["before"]), np.median(us["after"])
        what = "drain + decide + send" if args.socket else "handle + decide"
        print(f"{n:4d} streams: {what} per poll p50 before {before:8.1f} us, "
              f"after {after:8.1f} us, after / before {after / before:.3f}"
              f"{' (cold)' if args.cold else ''}")


if __name__ == "__main__":
    main()
