"""Held-out load cells for the simulator's fidelity (issue 13) on a real SGLang server (H200).

Phases (each starts its own server with ``offswitch.py``'s flags, drives it, stops it and
writes ``$OUT/<model>_<kind>_$TAG.json`` in a layout ``measured_runs.py`` reads):

    python scripts/h200/load_cells.py nospec   # no speculation: closed loops
    python scripts/h200/load_cells.py plugin   # EAGLE-3 + plugin, SGLANG_SIMULATE_ACC_LEN=$ACC:
                                               # closed loops per policy ($POLICIES)
    python scripts/h200/load_cells.py sglang   # EAGLE-3 with SGLang's own --speculative-adaptive
                                               # and 0.5.23's default config (depth up to 7), no
                                               # plugin, at $ACC: the 40-s headline, closed loops
    python scripts/h200/load_cells.py local    # the plugin in local decision mode
                                               # (SPECCTL_POLICY), one server per policy
    python scripts/h200/load_cells.py prefix   # no speculation, radix cache ON: the shared-
                                               # prefix workload (prefix_workload.py) with its
                                               # prefixes unique, then shared

Closed loops (``loadgen.closed_loop``): C = 1, 16 and 64 clients back to back, each sending
its next request while fewer than ``CLOSED_SECONDS`` (10) have passed; 256-token prompts,
128 output tokens, prompt ids drawn from a seed of their own per loop (and every server runs
``--disable-radix-cache``). With ``--max-running-requests 48``, 16 of C = 64's requests wait.

Environment: ``MODELS`` (model folders, as ``offswitch.py``), ``ACC``, ``POLICIES`` (plugin
phase, default ``static_0,static_1,static_3,ppo``; a policy named again is served again,
its loops kept as ``repeat_closed_<policy>``, ``repeat3_closed_<policy>``, ...: ``loop_key``),
``TAG`` (file suffix,
default ``run6``),
``CLOSED_C``, ``CLOSED_SECONDS``, ``WARMUP_SECONDS`` (plugin phase, default 5: an
unrecorded closed loop at the first C right after each policy is served, so the first
recorded loop does not start from the previous policy's state; run 6 had none, and the
policy's C = 1 loop on the MoE began with 3.5 s at depth 1 carried over from static 3 at
C = 64, ``docs/FIDELITY.md``), ``PREFIX_RATE`` (prefix phase: arrivals per second, default
``prefix_workload.RATE``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loadgen
import offswitch
import prefix_workload
import session

from agents.policies import SGLANG_DEFAULT_CONFIG

RUN, OUT, URL = session.RUN, session.OUT, session.URL
MODEL = "moe" if "moe" in offswitch.MODELS.name else "dense"
ACC = os.environ.get("ACC", "3.5")
TAG = os.environ.get("TAG", "run6")
CLOSED_C = [int(c) for c in os.environ.get("CLOSED_C", "1,16,64").split(",")]
CLOSED_SECONDS = float(os.environ.get("CLOSED_SECONDS", "10"))
WARMUP_SECONDS = float(os.environ.get("WARMUP_SECONDS", "5"))
TOKEN_MODE = offswitch.TOKEN_MODE


def closed_loops(seed: int) -> dict:
    """One closed loop per C; ``seed`` + C picks its prompt ids."""
    out = {}
    for c in CLOSED_C:
        out[str(c)] = loadgen.closed_loop(URL, c, CLOSED_SECONDS, seed=seed + c)
        session.log(f"closed C={c}: {out[str(c)]['throughput_tok_s']:.0f} tok/s, "
                    f"TPOT {out[str(c)]['mean_tpot_ms']:.2f} ms")
    return out


def sim_env() -> dict[str, str]:
    """Simulated acceptance with real tokens (offswitch.py's ``sim`` phase)."""
    return {"SGLANG_SIMULATE_ACC_LEN": ACC, "SGLANG_SIMULATE_ACC_TOKEN_MODE": TOKEN_MODE}


def loop_key(result: dict, policy: str) -> str:
    """Where the loops of ``policy``'s next serving on this server go in ``result``.

    ``closed_<policy>`` the first time, ``repeat_closed_<policy>`` the second,
    ``repeat<k>_closed_<policy>`` the k-th (k >= 3). A policy served several times on one
    server, interleaved with the others (``POLICIES=a,b,a,b``), measures the run's own
    repeat noise, against which a measured order of two policies is or is not established
    (``measured_runs.Cell.serving``, ``compare.established_pairs``).
    """
    key = f"closed_{policy}"
    if key not in result:
        return key
    serving = 2
    while f"{repeat_prefix(serving)}{key}" in result:
        serving += 1
    return f"{repeat_prefix(serving)}{key}"


def repeat_prefix(serving: int) -> str:
    """The key prefix of a policy's ``serving``-th loops on one server (1: none)."""
    return "" if serving == 1 else "repeat_" if serving == 2 else f"repeat{serving}_"


def save(kind: str, data: dict) -> None:
    session.save(f"{MODEL}_{kind}_{TAG}.json", data)


def phase_nospec() -> None:
    server = offswitch.start("nospec", spec=False, env={})
    result: dict = {"model": offswitch.MODELS.name, "closed_seconds": CLOSED_SECONDS}
    try:
        result["closed"] = closed_loops(seed=600)
        save("nospec", result)
    finally:
        session.stop(server, "nospec")
        offswitch.save_log(RUN / "server-nospec.log")


def phase_plugin() -> None:
    session.CANDIDATES = offswitch.CANDIDATES
    policies = session.write_policies()
    served = RUN / "policy.npz"
    shutil.copy(policies["static_3"], served)
    controller = session.start_controller(served, offswitch.PROFILE)
    # the plugin's own time per step on the scheduler thread (issue 12)
    # Written straight under $OUT, rewritten every few seconds by each scheduler process:
    # a phase stopped at the call's time limit still brings them back.
    timing = session.fresh(OUT / f"hooks_{MODEL}_{TAG}")
    server = offswitch.start("plugin", spec=True,
                             env={**offswitch.plugin_env("trace-load"), **sim_env(),
                                  "SPECCTL_HOOK_TIMING": str(timing / "hooks")})
    result: dict = {"model": offswitch.MODELS.name, "acceptance": float(ACC),
                    "profile": offswitch.PROFILE, "simulate_acc_token_mode": TOKEN_MODE,
                    "off_prefill": os.environ.get("SPECCTL_OFF_PREFILL", "skip"),
                    "closed_seconds": CLOSED_SECONDS, "warmup_seconds": WARMUP_SECONDS,
                    **session.served_policy(policies["ppo"])}
    names = os.environ.get("POLICIES", "static_0,static_1,static_3,ppo").split(",")
    try:
        for k, name in enumerate(names):
            session.serve_policy(served, policies[name])
            if WARMUP_SECONDS > 0:  # not recorded: the policy's own state, not the last one's
                loadgen.closed_loop(URL, CLOSED_C[0], WARMUP_SECONDS, seed=690 + 100 * k)
            result[loop_key(result, name)] = closed_loops(seed=700 + 100 * k)
            save(f"acc{ACC}_load", result)
    finally:
        session.stop(server, "plugin")
        if controller.poll() is None:
            session.stop(controller, "specctl-serve")
        offswitch.save_log(RUN / "server-plugin.log")
        # Each scheduler process rewrites its file every few seconds (sglang_hooks/timing.py).
        result["hook_timing"] = [json.loads(p.read_text()) for p in timing.glob("hooks.*.json")]
        save(f"acc{ACC}_load", result)
        if (RUN / "trace-load").exists():
            session.pack(RUN / "trace-load", f"{MODEL}_acc{ACC}_load_trace_{TAG}.tar.gz")


def phase_local() -> None:
    """The plugin in local decision mode (``SPECCTL_POLICY``: the exported policy evaluated
    on the plugin's I/O thread in the scheduler process, no controller), one server per
    policy of ``POLICIES`` (default ``static_3``): closed loops and the hooks' timing, to
    set beside the plugin phase's remote decisions in the same lease (issue 12)."""
    session.CANDIDATES = offswitch.CANDIDATES
    policies = session.write_policies()
    result: dict = {"model": offswitch.MODELS.name, "acceptance": float(ACC),
                    "mode": "local", "profile": offswitch.PROFILE,
                    "io_poll_us": os.environ.get("SPECCTL_IO_POLL_US", "default"),
                    "closed_seconds": CLOSED_SECONDS, "warmup_seconds": WARMUP_SECONDS,
                    "hook_timing": {}}
    for k, name in enumerate(os.environ.get("POLICIES", "static_3").split(",")):
        timing = session.fresh(OUT / f"hooks_{MODEL}_{TAG}_local_{name}")
        env = {key: value for key, value in offswitch.plugin_env("trace-local").items()
               if key != "SPECCTL_CONTROLLER"}  # no controller: the plugin decides
        env.update(sim_env(), SPECCTL_POLICY=str(policies[name]),
                   SPECCTL_PROFILE=offswitch.PROFILE,
                   SPECCTL_HOOK_TIMING=str(timing / "hooks"))
        server = offswitch.start(f"local-{name}", spec=True, env=env)
        try:
            if WARMUP_SECONDS > 0:
                loadgen.closed_loop(URL, CLOSED_C[0], WARMUP_SECONDS, seed=1690 + 100 * k)
            result[f"closed_{name}"] = closed_loops(seed=1700 + 100 * k)
            save(f"acc{ACC}_local", result)
        finally:
            session.stop(server, f"local-{name}")
            offswitch.save_log(RUN / f"server-local-{name}.log")
            result["hook_timing"][name] = [json.loads(p.read_text())
                                           for p in timing.glob("hooks.*.json")]
            save(f"acc{ACC}_local", result)
            if (RUN / "trace-local").exists():  # each server records afresh (plugin_env)
                session.pack(RUN / "trace-local",
                             f"{MODEL}_acc{ACC}_local_trace_{name}_{TAG}.tar.gz")


def phase_prefix() -> None:
    """The radix cache, measured: one server with it on, the same arrivals and lengths with
    every prompt its own (nothing to reuse) and with prefixes shared by groups."""
    rate = float(os.environ.get("PREFIX_RATE", prefix_workload.RATE))
    server = offswitch.start("prefix", spec=False, env={}, radix_cache=True)
    result: dict = {"model": offswitch.MODELS.name, "radix_cache": True,
                    "seconds": prefix_workload.SECONDS, "rate": rate,
                    "groups": prefix_workload.GROUPS,
                    "shared_blocks": prefix_workload.SHARED_BLOCKS,
                    "own_blocks": prefix_workload.OWN_BLOCKS,
                    "block_tokens": prefix_workload.BLOCK_TOKENS}
    try:
        for shared in (False, True):  # unique first: the shared run's prefixes start cold
            arrivals, blocks, outputs = prefix_workload.prefix_workload(shared, rate=rate)
            ids = [prefix_workload.token_ids(b) for b in blocks]
            key = "shared_prefix" if shared else "unique_prefix"
            result[key] = loadgen.replay(URL, arrivals, [len(i) for i in ids], outputs,
                                         prompt_ids=ids)
            session.log(f"{key}: {result[key]['throughput_tok_s']:.0f} tok/s, TTFT "
                        f"{result[key]['mean_ttft_ms']:.0f} ms, TPOT "
                        f"{result[key]['mean_tpot_ms']:.2f} ms")
            save("prefix", result)
    finally:
        session.stop(server, "prefix")
        offswitch.save_log(RUN / "server-prefix.log")


def phase_sglang() -> None:
    """SGLang's own rule: what a user gets from ``--speculative-adaptive`` out of the box."""
    server = offswitch.start("sglang", spec=True, env=sim_env(),
                             adaptive_config=SGLANG_DEFAULT_CONFIG, steps=7)
    result: dict = {"model": offswitch.MODELS.name, "acceptance": float(ACC),
                    "simulate_acc_token_mode": TOKEN_MODE, "closed_seconds": CLOSED_SECONDS,
                    "adaptive_config": SGLANG_DEFAULT_CONFIG}
    try:
        result["headline_sglang_adaptive"] = offswitch.headline()
        session.log(f"sglang headline: {result['headline_sglang_adaptive']}")
        save(f"acc{ACC}_sglang", result)
        result["closed_sglang_adaptive"] = closed_loops(seed=900)
        save(f"acc{ACC}_sglang", result)
    finally:
        session.stop(server, "sglang")
        offswitch.save_log(RUN / "server-sglang.log")


if __name__ == "__main__":
    RUN.mkdir(parents=True, exist_ok=True)
    for phase in sys.argv[1:]:
        {"nospec": phase_nospec, "plugin": phase_plugin, "sglang": phase_sglang,
         "prefix": phase_prefix, "local": phase_local}[phase]()
        time.sleep(2)
    session.log("done")
