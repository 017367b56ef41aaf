"""Where a daemon poll's thread CPU goes, per part: the daemon's own methods timed in place.

A diagnostic, not a test. One ``ControllerServer`` in this process; each poll, one telemetry
frame per stream goes through an inproc DEALER per stream, the process sleeps 0.5 ms (the
poll is not back to back with the last), then ``_drain`` + ``decide`` + ``_send`` run as
``poll_once`` runs them after its wait. Every listed method (and the module-level
``decode``, ``evaluate``, ``apply_guard``, ``decide_rows`` (``unsure_streams`` before it)
and the policy's ``logits`` and ``approximate_logits``, where they exist) is wrapped in
``time.thread_time_ns`` (a system call here: ~0.5 us per wrapped call, inside its callers'
totals too). Prints thread CPU per decision, the whole poll's and each part's (nested
parts inside their callers), the first fifth of the polls left out.

    python benchmarks/daemon_parts.py [--streams 8] [--polls 2000] [--policy FILE]
"""

from __future__ import annotations

import argparse
import functools
import gc
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import zmq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import controller.decider as decider  # noqa: E402
import controller.server as server_module  # noqa: E402
from benchmarks.bench_online import telemetry  # noqa: E402
from controller.policy_file import ExportedPolicy  # noqa: E402
from controller.reload import PolicyHolder  # noqa: E402
from controller.server import ControllerServer, ServeOptions  # noqa: E402
from controller.streams import keep_freed_memory  # noqa: E402

#: The server's methods timed (bound, on the instance). ``_handle_connections`` is where a
#: poll's frames go since the twentieth pass (``_handle_frames``, the sixteenth pass's
#: loop per connection, and ``handle_frame`` are its doors for one connection).
METHODS = ("_drain", "decide", "_send", "_fold", "_answer", "_observation_grids",
           "_handle_frames", "_handle_connections")


def timed(obj: object, name: str, spent: dict[str, int],
          clock: Callable[[], int] = time.thread_time_ns) -> None:
    """Replace ``obj.name`` with a wrapper adding its time by ``clock`` (ns; default the
    thread's CPU) to ``spent[name]``."""
    original = getattr(obj, name)

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        started = clock()
        try:
            return original(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0) + clock() - started

    setattr(obj, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--polls", type=int, default=2000)
    parser.add_argument("--policy", type=Path, help="default: a random policy (seed 1)")
    args = parser.parse_args()
    from threadpoolctl import threadpool_limits

    threadpool_limits(1, user_api="blas")  # as specctl-serve
    keep_freed_memory()
    path = Path(tempfile.mkdtemp(prefix="sc-parts-")) / "policy.npz"
    if args.policy is None:
        ExportedPolicy.random(seed=1).save(path)
    else:
        path.write_bytes(args.policy.read_bytes())
    server = ControllerServer(PolicyHolder(path),
                              ServeOptions(endpoint="inproc://parts", max_drain_s=10.0))
    spent: dict[str, int] = {}
    for name in METHODS:
        timed(server, name, spent)
    for module, name in ((server_module, "evaluate"), (server_module, "decode"),
                         (decider, "apply_guard")):
        timed(module, name, spent)
    timed(server.holder.policy, "logits", spent)  # exact: small polls, rechecked streams
    if hasattr(server.holder.policy, "approximate_logits"):  # the nineteenth pass's
        timed(server.holder.policy, "approximate_logits", spent)
        # the twentieth pass's arg-max with the marks, or the nineteenth's marks alone
        timed(decider, "decide_rows" if hasattr(decider, "decide_rows") else "unsure_streams",
              spent)
    dealers = []
    for _ in range(args.streams):
        dealer = server._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(server.endpoint)
        dealers.append(dealer)
    gc.freeze()
    gc.set_threshold(10_000, *gc.get_threshold()[1:])  # as specctl-serve
    skip, total = args.polls // 5, 0
    clock = time.thread_time_ns
    try:
        for k in range(args.polls):
            if k == skip:
                spent.clear()
                total = 0
            for i, dealer in enumerate(dealers):
                dealer.send(telemetry(f"s{i}", k + 1, 32))
            for dealer in dealers:  # the previous poll's answers
                while dealer.poll(0):
                    dealer.recv()
            time.sleep(0.0005)
            started = clock()
            server._send(server.decide(server._drain()))
            total += clock() - started
    finally:
        for dealer in dealers:
            dealer.close()
        server.close()
    decisions = (args.polls - skip) * args.streams
    print(f"thread CPU per decision, {args.streams} streams a poll: "
          f"{total / decisions / 1e3:.1f} us")
    for name, ns in sorted(spent.items(), key=lambda item: -item[1]):
        print(f"  {name:20s} {ns / decisions / 1e3:7.2f} us")


if __name__ == "__main__":
    main()
