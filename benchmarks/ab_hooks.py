"""Lock-step A/B of the source rank's hooks: two source trees in one server-like loop.

A diagnostic, not a test. Single runs of ``bench_hook_server.py`` on this shared 2-core
machine move by 2x with the other jobs' load; two source ranks stepped in alternating
order in one process see the same load, heap, collector and threads.

    python benchmarks/ab_hooks.py --before /path/to/other/checkout [--steps 3000]

Each tree's ``sglang_hooks``, ``controller`` and ``env`` are imported as their own copies
(as ``ab_daemon.py`` does). Each tree runs one source rank as the GPU run's plugin
phase does (a live ``specctl-serve``, one for both; recording; ``SPECCTL_HOOK_TIMING``)
in ``bench_hook_server``'s loop, with SGLang's work between the hooks; per launched step
the two trees take turns (the order alternates). Printed: each tree's clock per step
(p50/p90/p99, what the GPU server's JSON reports) and each hook's own time per call
(p50, mean, p99).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pickle
import random
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

from source_trees import load_tree

REPO = Path(__file__).resolve().parents[1]
#: What each tree imports (``source_trees.load_tree``).
PLUGIN_MODULES = ("sglang_hooks.runtime", "sglang_hooks.policy", "sglang_hooks.testing",
                  "sglang_hooks.recorder", "sglang_hooks.client", "sglang_hooks.compat",
                  "sglang_hooks.config", "benchmarks.bench_online",
                  "benchmarks.bench_hook_server", "controller.policy_file",
                  "env.traces.trace_format")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, default=REPO)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--no-recording", action="store_true")
    parser.add_argument("--wander", action="store_true",
                        help="decode batch sizes a random walk in 1..--batch (the same for "
                             "both trees), as a closed loop's are, instead of all --batch")
    parser.add_argument("--out", type=Path, default=None)
    args, rest = parser.parse_known_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    workdir = Path(tempfile.mkdtemp(prefix="sc-abh-"))
    modules, loops, runtimes, works = {}, {}, {}, {}
    controller = None
    for tag, root in trees.items():
        mods = modules[tag] = load_tree(root, PLUGIN_MODULES)
        bench = mods["benchmarks.bench_online"]
        server = mods["benchmarks.bench_hook_server"]
        options = server_options(server, rest)
        if controller is None:
            policy = workdir / "policy.npz"
            mods["controller.policy_file"].ExportedPolicy.random(seed=0).save(policy)
            endpoint = f"ipc://{workdir}/hooks.sock"
            controller = bench.start_controller(policy, endpoint)
            sglang_path = Path(options.sglang)
            work = server.SGLangWork(options)  # one heap and one SGLang for both trees
        # Each tree's stand-in classes get module names of their own (HookRegistry
        # patches a target name once).
        mods["sglang_hooks.testing"]._module_ids = itertools.count(1000 * len(runtimes))
        build = bench.rank_loop_builder(sglang_path, workdir / tag)
        config = mods["sglang_hooks.config"]
        compat = mods["sglang_hooks.compat"]
        extra = {} if args.no_recording else {"record_dir": str(workdir / tag / "rec")}
        rt = mods["sglang_hooks.runtime"].Runtime(
            config.PluginConfig(server=tag, controller=endpoint,
                                hook_timing=str(workdir / tag / "timing"), **extra),
            compat.installed_version(), ranks=compat.Ranks(0, 1, 0, 1, 0, False))
        runtimes[tag], loops[tag], works[tag] = rt, build(rt, True), work
    reqs = {tag: [modules[tag]["sglang_hooks.testing"].ReqStandIn(f"r{i}")
                  for i in range(options.batch)] for tag in trees}
    batch_of = {tag: modules[tag]["benchmarks.bench_online"].scheduler_batch for tag in trees}
    if args.wander:
        batch_of = {tag: wandering(modules[tag], args.steps, options.batch) for tag in trees}
    load_before = os.getloadavg()[0]
    try:
        order = list(trees)
        for i in range(args.steps):
            for tag in (order if i % 2 == 0 else order[::-1]):
                sys.modules.update(modules[tag])
                step(loops[tag], works[tag], batch_of[tag](i, reqs[tag]))
        summaries = {tag: rt.clock.summary() for tag, rt in runtimes.items()}
    finally:
        controller.kill()
        for rt in runtimes.values():
            rt.close()
    result = {"load_average_1min": [load_before, os.getloadavg()[0]], "steps": args.steps,
              "options": rest, "clock": summaries}
    print(f"load {load_before:.1f} -> {os.getloadavg()[0]:.1f}; {args.steps} steps each")
    print(f"{'per step (us)':28s} {'before':>8s} {'after':>8s} {'ratio':>6s}")
    for key in ("p50_us", "p90_us", "p99_us", "mean_us"):
        b, a = summaries["before"][key], summaries["after"][key]
        print(f"  {key:26s} {b:8.1f} {a:8.1f} {a / b:6.2f}")
    print("per hook call, p50 (mean) p99 us")
    for name in summaries["after"]["per_hook"]:
        b = summaries["before"]["per_hook"].get(name, {})
        a = summaries["after"]["per_hook"][name]
        print(f"  {name:26s} {b.get('p50_us', 0):6.1f} ({b.get('mean_us', 0):5.1f})"
              f" {b.get('p99_us', 0):6.1f}   {a.get('p50_us', 0):6.1f}"
              f" ({a.get('mean_us', 0):5.1f}) {a.get('p99_us', 0):6.1f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


def server_options(server: ModuleType, rest: list[str]) -> argparse.Namespace:
    """``bench_hook_server``'s options (its defaults, overridden by ``rest``)."""
    saved = sys.argv
    sys.argv = ["bench_hook_server", *rest]
    try:
        parser = argparse.ArgumentParser()
        for name, default in (("--batch", 64), ("--heap-m", 2.0), ("--sglang-touch", 400),
                              ("--sglang-allocs", 40), ("--release-every", 50),
                              ("--gpu-wait-us", 2000.0)):
            parser.add_argument(name, type=type(default), default=default)
        parser.add_argument("--sglang", default=str(REPO / ".sglang" / "0.5.23"))
        return parser.parse_args()
    finally:
        sys.argv = saved


def wandering(mods: dict[str, ModuleType], steps: int, largest: int):
    """``scheduler_batch`` with each decode step's batch size a random walk in
    ``1..largest`` (seeded: both trees see the same sizes)."""
    testing = mods["sglang_hooks.testing"]
    plain = mods["benchmarks.bench_online"].scheduler_batch
    rng = random.Random(0)
    sizes, size = [], largest // 2
    for _ in range(steps):
        size = max(1, min(largest, size + rng.choice((-2, -1, 0, 0, 0, 1, 2))))
        sizes.append(size)

    def batch(i: int, reqs: list):
        made = plain(i, reqs)
        if made.forward_mode.is_decode():
            return testing.BatchStandIn(reqs[:sizes[i]], testing.DECODE)
        return made
    return batch


def step(loop, work, batch) -> None:
    """One launched step of the server-like loop (``bench_hook_server.run_loop``'s body)."""
    work.work()
    pulled = loop.pull()
    scheduler = loop.scheduler
    scheduler.process_input_requests(pickle.loads(pickle.dumps(pulled)) if pulled else [])
    work.work()
    result = scheduler.run_batch(batch)
    launched = (batch.copy(), result)
    work.work()
    work.gpu_wait()
    if loop._in_flight is not None:
        scheduler.process_batch_result(*loop._in_flight)
    loop._in_flight = launched
    work.work()
    time.sleep(0)


if __name__ == "__main__":
    main()
