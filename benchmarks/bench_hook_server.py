"""The source rank's hooks under a server-like scheduler loop, read by the plugin's own clock.

Not a test: a diagnostic for the gap between ``bench_online.py``'s hook row and what
``SPECCTL_HOOK_TIMING`` reads on a real GPU server. ``bench_online`` runs the hooks in a
bare stand-in loop; a real scheduler process differs in ways that can reach the
plugin's time per step, and each is a switch here:

* ``--heap-m``: millions of live Python objects (a real scheduler holds torch, the model's
  modules and SGLang's state), and ``--sglang-touch``: SGLang's own work between hooks
  walks that many of them (cache and TLB misses) and keeps ``--sglang-allocs`` new
  objects per iteration alive for a while (gen-0 collections, some landing in a hook);
* ``--gpu-wait-us``: the wait for the GPU with the GIL released (``process_batch_result``
  waits on the step's copy), when the plugin's I/O and recorder threads run;
* ``--release-every``: SGLang's torch calls release the GIL every few microseconds
  (here a ``hashlib`` call over 4 KiB, which releases it), where another thread can
  take it;
* ``--idle-every``/``--idle-iterations``: the loop's idle iterations between requests
  (a closed loop at C = 1), which call the input hooks with no launch.

The plugin is the source rank with a live ``specctl-serve``, recording and
``SPECCTL_HOOK_TIMING``, as ``scripts/h200/load_cells.py`` runs it. Printed: the
clock's JSON (what the real server writes), and the loop's wall time per launched step
(p50/p99) with the plugin and, in the same process before it, without (``--no-plain``
skips that).

    python benchmarks/bench_hook_server.py [--steps 6000] [--out runs/hook_server.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import random
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_online import (  # noqa: E402
    rank_loop_builder,
    scheduler_batch,
    start_controller,
)
from controller.policy_file import ExportedPolicy  # noqa: E402


class _Obj:
    __slots__ = ("a", "b", "c")

    def __init__(self, i: int) -> None:
        self.a, self.b, self.c = i, [i], None


class SGLangWork:
    """What SGLang's own code does to the process between the plugin's hooks."""

    def __init__(self, args: argparse.Namespace) -> None:
        rng = random.Random(0)
        self.heap = [_Obj(i) for i in range(int(args.heap_m * 1e6))]
        rng.shuffle(self.heap)  # neighbours in the list are far apart in memory
        self.touch = args.sglang_touch if self.heap else 0
        self.allocs = args.sglang_allocs
        self.kept: list = [None] * 64  # a new object survives 64 work calls
        self.release_every = args.release_every
        self.buffer = b"x" * 4096  # hashlib releases the GIL over 2 KiB and more
        self.gpu_wait_s = args.gpu_wait_us / 1e6
        self._i = 0
        self._cursor = 0
        self.spent_ns: list[int] = []

    def work(self) -> None:
        """One slice of SGLang's CPU work (a quarter of an iteration's), timed: the
        plugin's other threads taking the GIL at its release points show here."""
        started = time.perf_counter_ns()
        self._work()
        self.spent_ns.append(time.perf_counter_ns() - started)

    def _work(self) -> None:
        heap, n = self.heap, len(self.heap)
        total = 0
        start = self._cursor
        for k in range(self.touch):
            obj = heap[(start + k * 7919) % n]
            total += obj.a
            if self.release_every and k % self.release_every == 0:
                hashlib.sha1(self.buffer)
        self._cursor = (start + self.touch * 7919 + 1) % max(n, 1)
        self._i += 1
        self.kept[self._i % 64] = [{"x": i} for i in range(self.allocs)]

    def gpu_wait(self) -> None:
        if self.gpu_wait_s > 0:
            time.sleep(self.gpu_wait_s)  # GIL released, as in a CUDA event wait


def work_summary(work: SGLangWork) -> dict[str, float]:
    """SGLang's work slices' wall time (us), the first tenth (warm-up) left out."""
    spent = np.asarray(work.spent_ns[len(work.spent_ns) // 10:]) / 1e3
    return {"p50": float(np.percentile(spent, 50)), "p99": float(np.percentile(spent, 99)),
            "mean": float(spent.mean())}


class _LookTimer:
    """Times each of the client I/O thread's looks (from the return of its wait between
    looks, the GIL taken again, to the next wait), wall clock and the thread's CPU. The
    wait is ``FdWait.wait`` in this tree, ``time.sleep`` in older ones (``--tree``)."""

    def __init__(self, module: ModuleType) -> None:
        self.looks: list[tuple[int, int]] = []  # (wall ns, thread CPU ns) per look
        self._woke: tuple[int, int] | None = None
        if hasattr(module, "FdWait"):
            wait = module.FdWait.wait  # also a zero-time check inside a look: not timed
            module.FdWait.wait = lambda fd_wait, seconds: (
                self._timed(wait, fd_wait, seconds) if seconds > 0 else wait(fd_wait, seconds))
        else:  # the running thread looks ``time`` up per call
            module.time = self

    def _timed(self, wait: Callable, *args: Any) -> Any:
        woke = self._woke
        if woke is not None:
            self.looks.append((time.perf_counter_ns() - woke[0], time.thread_time_ns() - woke[1]))
        try:
            return wait(*args)
        finally:
            self._woke = (time.perf_counter_ns(), time.thread_time_ns())

    def sleep(self, seconds: float) -> None:
        self._timed(time.sleep, seconds)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


class LookCost:
    """The client's I/O thread per look interval: its looks (wall time holding the GIL,
    less any release inside, and thread CPU, per look) and its CPU from Linux's
    per-thread ``schedstat`` (everything it did, HELLOs and GIL waits included)."""

    def __init__(self, client) -> None:
        import sglang_hooks.client

        self.client = client
        self.timer = _LookTimer(sglang_hooks.client)
        self.path = f"/proc/self/task/{client._thread.native_id}/schedstat"
        self.looks: dict[str, list[tuple[int, int]]] = {}
        self.totals: dict[str, list[float]] = {}  # name: [cpu ns, timeslices, seconds]
        self._mark: tuple[int, int, float, int] | None = None

    def _read(self) -> tuple[int, int, float, int]:
        with open(self.path) as f:
            cpu, _, slices = (int(x) for x in f.read().split())
        return cpu, slices, time.perf_counter(), len(self.timer.looks)

    def start(self) -> None:
        self._mark = self._read()

    def stop(self, name: str) -> None:
        now, mark = self._read(), self._mark
        total = self.totals.setdefault(name, [0, 0, 0.0])
        for k in range(3):
            total[k] += now[k] - mark[k]
        self.looks.setdefault(name, []).extend(self.timer.looks[mark[3]:now[3]])

    def summary(self) -> dict[str, dict[str, float]]:
        """Per interval: looks per second, a look's wall time and CPU (us: p50, mean), the
        thread's CPU per look and share of the wall time, its timeslices per look."""
        out = {}
        for name, (cpu, slices, seconds) in self.totals.items():
            looks = np.asarray(self.looks[name], dtype=float).reshape(-1, 2) / 1e3
            n = max(len(looks), 1)
            out[name] = {"looks_per_s": len(looks) / seconds,
                         "look_wall_p50_us": float(np.median(looks[:, 0])),
                         "look_wall_mean_us": float(looks[:, 0].mean()),
                         "look_cpu_p50_us": float(np.median(looks[:, 1])),
                         "look_cpu_mean_us": float(looks[:, 1].mean()),
                         "thread_cpu_per_look_us": cpu / n / 1e3,
                         "thread_cpu_share": cpu / 1e9 / seconds,
                         "timeslices_per_look": slices / n}
        return out


def run_loop(loop, work: SGLangWork, steps: int, args: argparse.Namespace,
             client=None) -> np.ndarray:
    """The loop in overlap order with SGLang's work between the hooks; returns the wall
    time (ns) of each iteration that launched a batch. With ``client`` and
    ``--alternate-poll-us``, its look interval alternates every 50 steps and each work
    slice is also kept under the interval it ran with (``work.by_poll``), and the I/O
    thread's CPU per look too (``work.look_cost``)."""
    from sglang_hooks.testing import ReqStandIn

    reqs = [ReqStandIn(f"r{i}") for i in range(args.batch)]
    walls = []
    modes = None  # (name, setter) pairs alternated every 50 steps
    if client is not None and args.alternate_poll_us is not None:
        modes = [(f"look every {v * 1e6:g} us", lambda v=v: setattr(client, "_poll_s", v))
                 for v in (client._poll_s, args.alternate_poll_us / 1e6)]
    if modes is not None:
        work.by_poll = {name: [] for name, _ in modes}
        work.look_cost = LookCost(client)
    for i in range(steps):
        if modes is not None:
            name, setter = modes[(i // 50) % 2]
            settled = i >= steps // 10
            if i % 50 == 0:
                setter()
                mark = len(work.spent_ns)
            elif i % 50 == 8 and settled:  # the new interval in force (a look has passed)
                work.look_cost.start()
            elif i % 50 == 49 and settled:  # a block's slices, once settled
                work.by_poll[name].extend(work.spent_ns[mark + 8:])
                work.look_cost.stop(name)
        if args.idle_every and i % args.idle_every == args.idle_every - 1:
            loop.drain()  # the batch in flight finishes, then the loop idles
            for _ in range(args.idle_iterations):
                pulled = loop.pull()
                loop.scheduler.process_input_requests(
                    pickle.loads(pickle.dumps(pulled)) if pulled else [])
                work.work()
        start = time.perf_counter_ns()
        work.work()  # receiving and broadcasting
        pulled = loop.pull()
        broadcast = pickle.loads(pickle.dumps(pulled)) if pulled else []
        scheduler = loop.scheduler
        scheduler.process_input_requests(broadcast)
        work.work()  # scheduling the next batch
        batch = scheduler_batch(i, reqs)
        result = scheduler.run_batch(batch)
        launched = (batch.copy(), result)
        work.work()  # launching the forward
        work.gpu_wait()
        if loop._in_flight is not None:
            scheduler.process_batch_result(*loop._in_flight)
        loop._in_flight = launched
        work.work()  # processing the result
        walls.append(time.perf_counter_ns() - start)
    loop.drain()
    return np.asarray(walls[len(walls) // 10:])


def use_tree(root: Path) -> None:
    """From now on, import the plugin's packages from ``root`` (this module and
    ``bench_online``, already imported, stay this tree's: their functions import the
    plugin when called)."""
    for name in [n for n in sys.modules if n.split(".")[0] in ("sglang_hooks", "controller",
                                                              "env")]:
        del sys.modules[name]
    sys.path.insert(0, str(root))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--heap-m", type=float, default=2.0)
    parser.add_argument("--sglang-touch", type=int, default=400)
    parser.add_argument("--sglang-allocs", type=int, default=40)
    parser.add_argument("--release-every", type=int, default=50)
    parser.add_argument("--gpu-wait-us", type=float, default=2000.0)
    parser.add_argument("--idle-every", type=int, default=50)
    parser.add_argument("--idle-iterations", type=int, default=20)
    parser.add_argument("--no-recording", action="store_true")
    parser.add_argument("--switch-interval-ms", type=float, default=None,
                        help="sys.setswitchinterval for the run (default: Python's 5 ms)")
    parser.add_argument("--poll-us", type=float, default=None,
                        help="the client I/O thread's look interval (default: the plugin's)")
    parser.add_argument("--alternate-poll-us", type=float, default=None,
                        help="interleave: every 50 steps switch the plugin's look interval "
                        "between its default and this; SGLang's work reported per interval")
    parser.add_argument("--no-plain", action="store_true")
    parser.add_argument("--plain-looks", action="store_true",
                        help="the client's looks as before the lean ones "
                        "(SPECCTL_IO_PLAIN_LOOKS=1)")
    parser.add_argument("--held-send", action="store_true",
                        help="the client's sends keep the GIL (SPECCTL_IO_HELD_SEND=1)")
    parser.add_argument("--tree", type=Path, default=None,
                        help="another checkout whose plugin (sglang_hooks, controller, env) "
                        "runs in the loop; the benchmark and specctl-serve stay this tree's")
    parser.add_argument("--sglang", type=Path, default=REPO / ".sglang" / "0.5.23")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result: dict = {"args": {k: str(v) for k, v in vars(args).items()},
                    "load_average_1min_before": os.getloadavg()[0]}
    if args.tree is not None:
        use_tree(args.tree.resolve())
    with tempfile.TemporaryDirectory(prefix="sc-hs-", ignore_cleanup_errors=True) as tmp:
        workdir = Path(tmp)
        build = rank_loop_builder(args.sglang, workdir)
        from sglang_hooks.compat import Ranks, installed_version
        from sglang_hooks.config import PluginConfig
        from sglang_hooks.runtime import Runtime

        work = SGLangWork(args)
        if args.switch_interval_ms is not None:
            sys.setswitchinterval(args.switch_interval_ms / 1e3)
        if args.poll_us is not None:
            import sglang_hooks.client

            sglang_hooks.client._POLL_S = args.poll_us / 1e6
        if not args.no_plain:
            walls = run_loop(build(None, True), work, args.steps, args)
            result["plain_wall_us"] = {"p50": float(np.percentile(walls, 50)) / 1e3,
                                       "p99": float(np.percentile(walls, 99)) / 1e3}
        policy = workdir / "policy.npz"
        ExportedPolicy.random(seed=0).save(policy)
        endpoint = f"ipc://{workdir}/hooks.sock"
        controller = start_controller(policy, endpoint)
        extra = {} if args.no_recording else {"record_dir": str(workdir / "rec")}
        if args.plain_looks:
            extra["io_plain_looks"] = True
        if args.held_send:
            extra["io_held_send"] = True
        rt = Runtime(PluginConfig(server="h", controller=endpoint,
                                  hook_timing=str(workdir / "timing"), **extra),
                     installed_version(), ranks=Ranks(0, 1, 0, 1, 0, False))
        if "plain_wall_us" in result:
            result["plain_sglang_work_us"] = work_summary(work)
        work.spent_ns = []
        try:
            walls = run_loop(build(rt, True), work, args.steps, args, rt.client)
            result["plugin_sglang_work_us"] = work_summary(work)
            if getattr(work, "by_poll", None):
                result["sglang_work_by_look_us"] = {
                    name: {"p50": float(np.percentile(spent, 50)) / 1e3,
                           "mean": float(np.mean(spent)) / 1e3, "n": len(spent)}
                    for name, spent in work.by_poll.items()}
                result["io_thread_by_look"] = work.look_cost.summary()
                print("SGLang's work per slice by the client's look interval (us):",
                      result["sglang_work_by_look_us"])
                print("The client's I/O thread by look interval:", result["io_thread_by_look"])
            result["plugin_wall_us"] = {"p50": float(np.percentile(walls, 50)) / 1e3,
                                        "p99": float(np.percentile(walls, 99)) / 1e3}
            result["clock"] = rt.clock.summary()
            result["counters"] = {**rt.counters, **(rt.client.counters if rt.client else {})}
        finally:
            controller.kill()
            rt.close()
    result["load_average_1min_after"] = os.getloadavg()[0]
    clock = result["clock"]
    print(f"load {result['load_average_1min_before']:.1f} -> "
          f"{result['load_average_1min_after']:.1f}")
    print(f"plugin's clock per step: p50 {clock['p50_us']:.1f} us, p90 {clock['p90_us']:.1f}, "
          f"p99 {clock['p99_us']:.1f}, max {clock['max_us']:.0f}, mean {clock['mean_us']:.1f}"
          f" ({clock['steps']} steps)")
    # An older tree's clock (--tree) may lack the fields below.
    for name, hook in clock.get("per_hook", {}).items():
        print(f"  {name:24s} calls {hook['n']:6d}  p50 {hook['p50_us']:6.1f}  "
              f"p99 {hook['p99_us']:7.1f}  mean {hook['mean_us']:6.1f}")
    if "idle_iterations" in clock:
        idle, gcs = clock["idle_iterations"], clock["gc"]
        print(f"idle iterations {idle['n']} ({idle['total_us']:.0f} us); gc in hooks "
              f"{gcs['in_hooks'].get('n', 0)} (mean {gcs['in_hooks'].get('mean_us', 0):.1f} "
              f"us) of {gcs['all'].get('n', 0)}")
    for key in ("plain_wall_us", "plugin_wall_us"):
        if key in result:
            print(f"loop wall per step, {key[:-8]}: p50 {result[key]['p50']:.0f} us, "
                  f"p99 {result[key]['p99']:.0f}")
    for key in ("plain_sglang_work_us", "plugin_sglang_work_us"):
        if key in result:
            print(f"SGLang's own work per slice, {key.split('_')[0]}: "
                  f"p50 {result[key]['p50']:.1f} us, p99 {result[key]['p99']:.1f}, "
                  f"mean {result[key]['mean']:.1f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
