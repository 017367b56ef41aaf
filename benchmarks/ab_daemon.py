"""Lock-step A/B of the daemon's per-poll work: two source trees in one process.

A diagnostic, not a test. On this shared 2-core machine single benchmark runs move by
more than a few percent with the other engineers' load; two servers measured poll by
poll, in alternating order, in one process, see the same load.

    python benchmarks/ab_daemon.py --before /path/to/other/checkout [--streams 1 5 64]

Each tree's ``controller`` and ``env`` packages are imported as their own copies (the
module table is swapped to a tree's copies while its server runs: the feature builder
imports its compiled backend lazily). Per poll, both servers take the same telemetry
frames (``handle_frame``, one frame per stream) and answer them (``decide``), each timed
in thread CPU; the daemon's process settings (one BLAS thread, ``keep_freed_memory``,
the garbage collector's) apply to both. Every 97th poll's decisions must be equal.
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
                  "controller.streams", "env.features_compiled", "benchmarks.bench_online")


def measure(trees: dict[str, Path], streams: int, polls: int) -> dict[str, np.ndarray]:
    """Thread CPU (us) of each tree's handle_frame + decide per poll, lock-step."""
    tmp = Path(tempfile.mkdtemp(prefix="sc-ab-"))
    servers, modules = {}, {}
    for tag, root in trees.items():
        mods = modules[tag] = load_tree(root, DAEMON_MODULES)
        server_mod = mods["controller.server"]
        path = tmp / f"{tag}.npz"
        mods["controller.policy_file"].ExportedPolicy.random(seed=1).save(path)
        mods["controller.streams"].keep_freed_memory()
        servers[tag] = server_mod.ControllerServer(
            mods["controller.reload"].PolicyHolder(path),
            server_mod.ServeOptions(endpoint=f"ipc://{tmp}/{tag}.sock"))
    telemetry = modules["after"]["benchmarks.bench_online"].telemetry  # frames for both
    peers = [(b"peer%d" % i, "") for i in range(streams)]
    frames = [[telemetry(f"s{i}", k + 1, 32) for i in range(streams)] for k in range(polls)]
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
                started = clock()
                for peer, frame in zip(peers, frames[k], strict=True):
                    server.handle_frame(peer, frame, pending, 0.0)
                out = server.decide(pending)
                spent[tag].append(clock() - started)
                if k % 97 == 0:
                    seen[tag].append([(d.seq, d.apply_from_step, d.batch_grid, d.steps)
                                      for _, d in out])
    finally:
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
    args = parser.parse_args()
    # each tree's env package registers the same gymnasium env id: expected here
    warnings.filterwarnings("ignore", message=".*Overriding environment")
    from threadpoolctl import threadpool_limits

    threadpool_limits(1, user_api="blas")
    for n in args.streams:
        us = measure({"before": args.before.resolve(), "after": args.after.resolve()},
                     n, args.polls)
        before, after = np.median(us["before"]), np.median(us["after"])
        print(f"{n:4d} streams: handle + decide per poll p50 before {before:8.1f} us, "
              f"after {after:8.1f} us, after / before {after / before:.3f}")


if __name__ == "__main__":
    main()
