"""The off switch on a real SGLang server (H200): is a step decided 0 as fast as no speculation?

Phases (each starts its own server, drives it, stops it, writes ``$OUT/offswitch_<phase>.json``):

    python scripts/h200/offswitch.py nospec   # a server without any --speculative-* flag
    python scripts/h200/offswitch.py off      # EAGLE-3 + plugin, no simulated acceptance:
                                              # greedy ids under off / depth 3 / switching every
                                              # step, and the off path's TPOT
    python scripts/h200/offswitch.py sim      # EAGLE-3 + plugin, SGLANG_SIMULATE_ACC_LEN=$ACC:
                                              # the replay with static 0 / static 3 / the policy

Environment: ``MODELS`` (model folders), ``ACC`` (simulated acceptance), ``REPS`` (one-batch
sweeps per C, default 1), ``HEADLINE`` (0: skip the replay in nospec/off; ``only``: in
nospec, the replay and nothing else), ``HEADLINE_RATES`` (nospec and sim: replay at each of
these mean arrival rates, requests/s, one file per rate ``offswitch_<phase>_r<rate>.json``;
default: one replay at ``session.headline_rate()``, ``offswitch_<phase>.json``), ``POLICIES``
(sim: which policies replay), ``PROFILE`` (the cost profile handed to specctl-serve; by
default the one of the model's shape), ``PROFILE_C`` (concurrency of a torch-profiler
trace of the decode steps, 0: none), ``SWITCH_SECONDS`` (off: closed loop while every step
switches depth, sampling GPU and host memory; 0: none), ``COMPILE_LOG`` (1: every Triton and
torch.compile compile in the server's processes, timed, into ``$OUT/compiles-<phase>.jsonl``;
``scripts/h200/compile_log.py``), ``EXTRA_POLICIES`` (``session.write_policies``),
``WARMUP_RAMP`` (sim, 1: every candidate depth at batch sizes 1-48 before the replays),
``PREFILL_PROBE`` (nospec with ``HEADLINE=only``, and sim, 1: after the replays, TTFT of one
request at a time with 1 and 2 output tokens per prompt length, on the sim server under
static 0 and static 3), ``SERVER_ARGS`` (more SGLang flags for every server,
space-separated, e.g. ``--warmups specctl``; recorded in the run file with the seconds the
server took to answer), ``HOOK_TIMING`` (off and sim, 1: the plugin's own time per step on
the scheduler thread, ``SPECCTL_HOOK_TIMING``, each scheduler process's summary under
``$OUT/hooks_<record>/``, rewritten every few seconds, over the server's whole life).

Every server: the same flags (``session.py``'s), ``--disable-radix-cache`` (replayed prompts
would otherwise hit the prefix cache of earlier runs) and ``--max-running-requests 48``.
``MODELS=<dir>`` picks the model folders (``.h200/models`` by default: Llama-3.1-8B shape).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loadgen
import profile_summary
import session

RUN, OUT, URL = session.RUN, session.OUT, session.URL
MODELS = Path(os.environ.get("MODELS", str(session.MODELS)))
ACC = os.environ.get("ACC", "3.5")
CANDIDATES = [0, 1, 3, 5]
CONCURRENCY = [1, 8, 32, 48]
REPS = int(os.environ.get("REPS", "1"))
TOKEN_MODE = os.environ.get("SGLANG_SIMULATE_ACC_TOKEN_MODE", "real-draft-token")
PROFILE_C = int(os.environ.get("PROFILE_C", "48"))
SKIP_SERVER_WARMUP = os.environ.get("SKIP_SERVER_WARMUP") == "1"
SWITCH_SECONDS = float(os.environ.get("SWITCH_SECONDS", "0"))
PROFILE = os.environ.get("PROFILE") or (
    "h200_qwen3_30b_a3b" if "moe" in MODELS.name else "h200_llama31_8b_recorded")
SERVER_ARGS = os.environ.get("SERVER_ARGS", "").split()
#: Seconds from launch until each server (by name) answered /health: a start-up warm-up
#: (``--warmups``) runs before the server listens, so its cost shows here.
READY_S: dict[str, float] = {}
GREEDY_PROMPTS, GREEDY_PROMPT_LEN, GREEDY_NEW = 8, 200, 64
PREFILL_LENGTHS = (256, 1024, 3072)


def start(name: str, *, spec: bool, env: dict[str, str], adaptive_config: dict | None = None,
          steps: int | None = None, radix_cache: bool = False) -> subprocess.Popen:
    """Start a server and wait until it answers; ``spec``: EAGLE-3 with ``--speculative-adaptive``.

    Every comparison runs with ``--disable-radix-cache``; ``radix_cache`` leaves SGLang's
    default (on) for a run that measures the cache itself (``load_cells.py prefix``).

    ``adaptive_config`` (SGLang's ``--speculative-adaptive-config``; default: every candidate
    depth at every batch size, which the plugin needs) and ``steps`` (the deepest, default
    ``max(CANDIDATES)``) are for speculative servers.
    """
    args = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(MODELS / "target"),
            "--load-format", "dummy", "--skip-tokenizer-init", "--attention-backend", "triton",
            "--sampling-backend", "pytorch", "--cuda-graph-max-bs", "64",
            "--max-running-requests", "48", "--context-length", "4096",
            "--mem-fraction-static", "0.8",
            "--port", str(session.PORT), "--log-level", "info"]
    if not radix_cache:
        args.append("--disable-radix-cache")
    if SKIP_SERVER_WARMUP:  # SGLang's warm-up request decodes at batch 1: acceptance measured
        args.append("--skip-server-warmup")
    if spec:
        steps = steps or max(CANDIDATES)
        config = RUN / "adaptive.json"
        config.write_text(json.dumps(adaptive_config or {"1": {"candidate_steps": CANDIDATES}}))
        args += ["--speculative-draft-model-path", str(MODELS / "draft"),
                 "--speculative-algorithm", "EAGLE3", "--speculative-eagle-topk", "1",
                 "--speculative-num-steps", str(steps),
                 "--speculative-num-draft-tokens", str(steps + 1),
                 "--speculative-adaptive", "--speculative-adaptive-config", str(config)]
    args += SERVER_ARGS
    if os.environ.get("COMPILE_LOG") == "1":  # every JIT compile, timed (compile_log.py)
        env = {**env, "SPECCTL_COMPILE_LOG": str(session.fresh(RUN / f"compiles-{name}")),
               "TORCH_LOGS": "recompiles"}
    log_path = RUN / f"server-{name}.log"
    process = subprocess.Popen(args, env={**os.environ, **env}, stdout=open(log_path, "w"),  # noqa: SIM115
                               stderr=subprocess.STDOUT, start_new_session=True)
    started = time.time()
    while time.time() - started < 420:
        if process.poll() is not None:
            save_log(log_path)
            raise RuntimeError(f"server {name} exited:\n" + log_path.read_text()[-4000:])
        try:
            with urllib.request.urlopen(f"{URL}/health", timeout=2) as response:
                if response.status == 200:
                    READY_S[name] = round(time.time() - started, 1)
                    session.log(f"{name} ready after {READY_S[name]:.0f} s")
                    if not SKIP_SERVER_WARMUP:
                        loadgen.one_batch(URL, 2, output=16)
                    return process
        except OSError:
            pass
        time.sleep(2)
    raise RuntimeError(f"server {name} not ready")


def save_log(path: Path) -> None:
    """Copy a server's log (its last MB) and, with ``COMPILE_LOG=1``, its compile log."""
    OUT.mkdir(parents=True, exist_ok=True)
    text = path.read_text()
    (OUT / path.name).write_text(text[-1_000_000:])
    compiles = RUN / path.stem.replace("server-", "compiles-", 1)
    if compiles.is_dir():
        lines = [line for file in sorted(compiles.glob("*.jsonl"))
                 for line in file.read_text().splitlines()]
        (OUT / f"{compiles.name}.jsonl").write_text("\n".join(lines) + "\n")


def post(path: str, payload: dict) -> str:
    request = urllib.request.Request(f"{URL}{path}", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.read().decode()


def profile_decode(name: str, concurrency: int = PROFILE_C, steps: int = 40) -> dict:
    """A torch-profiler trace of ``steps`` decode steps of a C-request batch, summarised.

    The batch asks for 512 tokens each, so the profile (started 1 s in, past the
    prefills) sees decode steps only.
    """
    if concurrency <= 0:
        return {}
    folder = RUN / "profiles" / name
    folder.mkdir(parents=True, exist_ok=True)
    load: dict = {}
    thread = threading.Thread(target=lambda: load.update(
        loadgen.one_batch(URL, concurrency, output=512, seed=300 + concurrency)))
    thread.start()
    time.sleep(1.0)
    try:
        post("/start_profile", {"output_dir": str(folder), "num_steps": steps,
                                "activities": ["CPU", "GPU"], "profile_id": name,
                                "with_stack": False, "record_shapes": False})
    except OSError as error:
        thread.join()
        return {"error": f"start_profile: {error}"}
    thread.join()
    deadline = time.time() + 90
    traces: list[Path] = []
    while time.time() < deadline and not traces:
        time.sleep(2)
        traces = sorted(folder.rglob("*.json.gz")) or sorted(folder.rglob("*.json"))
    time.sleep(2)  # the exporter may still be writing
    summary = {"concurrency": concurrency, "steps": steps, "load": load,
               "traces": [profile_summary.summarise(path) for path in traces]}
    for path in traces:
        if path.stat().st_size < 30_000_000:
            shutil.copy(path, OUT / f"profile_{name}_{path.name}")
    session.log(f"profile {name}: " + json.dumps(
        [{k: s.get(k) for k in ("window_ms", "gpu_busy_fraction", "graph_launches")}
         for s in summary["traces"]]))
    return summary


def server_processes(server: subprocess.Popen) -> list:
    import psutil

    return [server_process for server_process in
            psutil.Process(server.pid).children(recursive=True)
            if "scheduler" in " ".join(server_process.cmdline()).lower()
            or "scheduler" in server_process.name().lower()]


def memory_sample(server: subprocess.Popen) -> dict:
    """GPU memory used by the server's processes (nvidia-smi) and the schedulers' RSS."""
    gpu = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True)
    used = [int(line.split(",")[1]) for line in gpu.stdout.strip().splitlines() if "," in line]
    schedulers = server_processes(server)
    return {"t": time.time(), "gpu_mib": sum(used),
            "scheduler_rss_mib": [round(p.memory_info().rss / 2**20, 1) for p in schedulers]}


def switching_memory(server: subprocess.Popen, seconds: float) -> dict:
    """A closed loop of 4 clients while every step switches depth; memory every 10 s."""
    samples = [memory_sample(server)]
    load: dict = {}
    thread = threading.Thread(target=lambda: load.update(
        loadgen.closed_loop(URL, 4, seconds, seed=400)))
    thread.start()
    while thread.is_alive():
        thread.join(timeout=10)
        samples.append(memory_sample(server))
    session.log(f"switching memory {samples[0]} -> {samples[-1]}")
    return {"seconds": seconds, "load": load, "samples": samples}


def greedy_ids() -> list[dict]:
    """Eight fixed prompts at once, greedy; output ids and the top-2 logprobs per position."""
    rng = random.Random(1234)
    prompts = [[rng.randrange(1000, 100_000) for _ in range(GREEDY_PROMPT_LEN)]
               for _ in range(GREEDY_PROMPTS)]
    payload = {"input_ids": prompts,
               "sampling_params": {"max_new_tokens": GREEDY_NEW, "temperature": 0.0,
                                   "ignore_eos": True},
               "return_logprob": True, "top_logprobs_num": 2}
    request = urllib.request.Request(f"{URL}/generate", data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        answers = json.loads(response.read())
    out = []
    for answer in answers:
        top = answer["meta_info"].get("output_top_logprobs") or []
        gaps = [float(p[0][0] - p[1][0]) if p and len(p) > 1 else None for p in top]
        out.append({"output_ids": answer["output_ids"], "top2_gap": gaps})
    return out


def sweep() -> dict:
    """One batch per C (``REPS`` times each: ``"<C>"`` is the first, ``"<C>#<k>"`` repeats)."""
    out = {}
    for rep in range(REPS):
        for c in CONCURRENCY:
            out[str(c) if rep == 0 else f"{c}#{rep}"] = loadgen.one_batch(
                URL, c, seed=100 + c + 1000 * rep)
    return out


def prefill_probe(name: str, reps: int = 5, output: int = 2) -> dict:
    """The prefill's cost: one request at a time (``output`` tokens) per prompt length, TTFT.
    With ``output=1`` the request ends at its prefill, so a first token that waits for
    the next decode step shows as a gap between the two."""
    out = {}
    for length in PREFILL_LENGTHS:
        ttfts = [loadgen.one_batch(URL, 1, prompt=length, output=output,
                                   seed=300 + length + k)["mean_ttft_ms"] for k in range(reps)]
        out[str(length)] = {"ttft_ms": ttfts, "median_ttft_ms": statistics.median(ttfts)}
    session.log(f"{name} prefill (output {output}) "
                + json.dumps({n: v["median_ttft_ms"] for n, v in out.items()}))
    return out


def prefill_probes(name: str) -> dict:
    """:func:`prefill_probe` with 1 and with 2 output tokens (``PREFILL_PROBE=1``: after a
    headline replay, the off path's prefill against a server without speculation's)."""
    return {f"output_{output}": prefill_probe(name, reps=8, output=output) for output in (1, 2)}


def headline(rate: float | None = None) -> dict:
    arrivals, prompts, outputs = session.headline_workload(rate=rate)
    return loadgen.replay(URL, arrivals, prompts, outputs)


def headline_rates() -> list[tuple[float | None, str]]:
    """(rate, file suffix) per replay of ``HEADLINE_RATES``; unset: the default rate, no
    suffix (the file names of runs 1-5). A rate's second replay has suffix ``_r8_2``."""
    value = os.environ.get("HEADLINE_RATES", "")
    if not value:
        return [(None, "")]
    try:
        rates = [float(rate) for rate in value.split(",")]
    except ValueError:
        raise SystemExit(f"HEADLINE_RATES={value!r} is not a comma-separated list of "
                         "requests/s") from None
    if not all(rate > 0 for rate in rates):
        raise SystemExit(f"HEADLINE_RATES={value!r}: every rate must be > 0")
    # A rate repeated (a warm-up replay, then the one measured) gets a file of its own.
    seen: dict[float, int] = {}
    out = []
    for rate in rates:
        seen[rate] = seen.get(rate, 0) + 1
        out.append((rate, f"_r{rate:g}" + (f"_{seen[rate]}" if seen[rate] > 1 else "")))
    return out


def save(name: str, data: dict) -> None:
    session.save(f"offswitch_{name}.json", data)


def phase_nospec() -> None:
    server = start("nospec", spec=False, env={})
    result: dict = {"model": MODELS.name, "server_args": SERVER_ARGS,
                    "ready_s": READY_S["nospec"]}
    try:
        if os.environ.get("HEADLINE") == "only":
            for rate, suffix in headline_rates():
                replay = {**result, "headline_rate": rate or session.headline_rate(),
                          "headline": headline(rate)}
                session.log(f"nospec headline{suffix} {replay['headline']}")
                save(f"nospec{suffix}", replay)
            if os.environ.get("PREFILL_PROBE") == "1":
                save("nospec_prefill", {**result, "prefill": prefill_probes("nospec")})
            return
        result["greedy"] = greedy_ids()
        result["sweep"] = sweep()
        session.log("nospec sweep " + json.dumps({c: v["mean_tpot_ms"]
                                                  for c, v in result["sweep"].items()}))
        result["prefill"] = prefill_probe("nospec")
        save("nospec", result)
        result["profile"] = profile_decode("nospec")
        save("nospec", result)
        if os.environ.get("HEADLINE", "1") == "1":
            result["headline"] = headline()
            session.log(f"nospec headline {result['headline']}")
            save("nospec", result)
    finally:
        session.stop(server, "nospec")
        save_log(RUN / "server-nospec.log")


def plugin_env(record: str) -> dict[str, str]:
    """The plugin's variables for a server about to start, recording into a fresh
    ``RUN / record`` (not with ``NO_RECORD=1``: the hooks' time without the recorder)."""
    env = {"SPECCTL_CONTROLLER": session.SOCKET, "SPECCTL_TIMEOUT_MS": "100",
           "SPECCTL_SERVER": "h200", "SPECCTL_FALLBACK": "explore",
           "SPECCTL_EXPLORE_DWELL": "1", "SPECCTL_RECORD": str(session.fresh(RUN / record)),
           "SPECCTL_RECORD_FLUSH_S": "2"}
    if os.environ.get("NO_RECORD") == "1":
        del env["SPECCTL_RECORD"], env["SPECCTL_RECORD_FLUSH_S"]
    if os.environ.get("HOOK_TIMING") == "1":  # straight under $OUT: a killed call keeps it
        env["SPECCTL_HOOK_TIMING"] = str(session.fresh(OUT / f"hooks_{record}") / "hooks")
    return env


def phase_off() -> None:
    """No simulated acceptance: real (random-weight) drafts, so outputs must be greedy's."""
    session.CANDIDATES = CANDIDATES
    policies = session.write_policies()
    served = RUN / "policy.npz"
    shutil.copy(policies["static_0"], served)
    controller = session.start_controller(served, PROFILE)
    server = start("off", spec=True, env=plugin_env("trace-off"))
    result: dict = {"model": MODELS.name, "candidates": CANDIDATES,
                    "off_prefill": os.environ.get("SPECCTL_OFF_PREFILL", "skip")}
    try:
        for name in ("static_0", "static_3"):
            session.serve_policy(served, policies[name])
            result[f"greedy_{name}"] = greedy_ids()
        session.serve_policy(served, policies["static_0"])
        result["sweep_off"] = sweep()
        session.log("off sweep " + json.dumps({c: v["mean_tpot_ms"]
                                               for c, v in result["sweep_off"].items()}))
        # A prefill while off (SPECCTL_OFF_PREFILL: skip by default), then with EAGLE's
        # prefill work (depth 3 served: the first request's prefill may still be off).
        result["prefill_off"] = prefill_probe("off")
        save("off", result)
        result["profile_off"] = profile_decode("off")
        session.serve_policy(served, policies["static_3"])
        result["prefill_static_3"] = prefill_probe("static_3")
        result["profile_static_3"] = profile_decode("static_3")
        session.serve_policy(served, policies["static_0"])
        save("off", result)
        if os.environ.get("HEADLINE", "1") == "1":
            result["headline_off"] = headline()
            session.log(f"off headline {result['headline_off']}")
            save("off", result)
        # Controller gone: every rank falls back to the explore rule, dwell 1, which
        # switches depth (0, 1, 3, 5 in a shuffled order) on every step.
        session.stop(controller, "specctl-serve")
        time.sleep(1.0)
        if SWITCH_SECONDS > 0:
            result["switching_memory"] = switching_memory(server, SWITCH_SECONDS)
            save("off", result)
        result["greedy_switching"] = greedy_ids()
        result["sweep_switching"] = {str(c): loadgen.one_batch(URL, c, seed=200 + c)
                                     for c in (1, 32)}
        save("off", result)
        time.sleep(4)
    finally:
        session.stop(server, "off")
        if controller.poll() is None:
            session.stop(controller, "specctl-serve")
        save_log(RUN / "server-off.log")
        if (RUN / "trace-off").exists():
            session.pack(RUN / "trace-off", "offswitch_trace_off.tar.gz")


#: Batch sizes of the warm-up ramp: one in every power-of-two bucket up to the 48 the
#: servers admit (Triton kernels specialise on such buckets, ``compile_log.py``).
RAMP_BATCHES = (1, 2, 3, 5, 9, 17, 33, 48)


def warmup_ramp(served: Path, policies: dict[str, Path]) -> dict:
    """Each candidate depth (a constant policy) decoding a batch of every size in
    :data:`RAMP_BATCHES`, 24 tokens each: every (depth, batch bucket) runs once before the
    replays, so first-use work (compiles) is not paid while serving. Returns seconds
    per depth. The load generator's ramp that run 42 measured; the plugin's own start-up
    version (``--warmups specctl``) is :mod:`sglang_hooks.warmup`."""
    seconds = {}
    for steps in CANDIDATES:
        session.serve_policy(served, policies[f"static_{steps}"])
        started = time.time()
        for batch in RAMP_BATCHES:
            loadgen.one_batch(URL, batch, prompt=128, output=24, seed=900 + batch)
        seconds[f"static_{steps}"] = round(time.time() - started, 2)
    session.log(f"warm-up ramp: {seconds}")
    return seconds


def phase_sim() -> None:
    session.CANDIDATES = CANDIDATES
    policies = session.write_policies()
    served = RUN / "policy.npz"
    shutil.copy(policies["static_3"], served)
    controller = session.start_controller(served, PROFILE)
    # Real tokens: SGLang's default token mode writes id 100 for every generated token,
    # which routes every request of an MoE to the same experts (cheap, unreal steps).
    env = {**plugin_env("trace-sim"), "SGLANG_SIMULATE_ACC_LEN": ACC,
           "SGLANG_SIMULATE_ACC_TOKEN_MODE": TOKEN_MODE}
    server = start("sim", spec=True, env=env)
    result: dict = {"model": MODELS.name, "acceptance": float(ACC), "profile": PROFILE,
                    "off_prefill": os.environ.get("SPECCTL_OFF_PREFILL", "skip"),
                    "simulate_acc_token_mode": TOKEN_MODE,
                    "server_args": SERVER_ARGS, "ready_s": READY_S["sim"],
                    "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR"),
                    **session.served_policy(policies["ppo"]),
                    # what each EXTRA_POLICIES name served (its guard is its file's)
                    "extra_policies": {name: session.served_policy(policies[name])
                                       for name in session.extra_policies()}}
    try:
        if os.environ.get("WARMUP_RAMP") == "1":
            result["warmup_ramp"] = warmup_ramp(served, policies)
        for rate, suffix in headline_rates():
            replay = {**result, "headline_rate": rate or session.headline_rate()}
            for name in os.environ.get("POLICIES", "static_3,ppo,static_0").split(","):
                session.serve_policy(served, policies[name])
                # A name served again in one replay gets its own key (run 90 served m2,
                # ppo, m2 and kept only the second m2): headline_m2, headline_m2_2, ...
                key, n = f"headline_{name}", 2
                while key in replay:
                    key, n = f"headline_{name}_{n}", n + 1
                replay[key] = headline(rate)
                session.log(f"sim headline{suffix} {name}: {replay[key]}")
                save(f"sim{suffix}", replay)
        if os.environ.get("PREFILL_PROBE") == "1":
            probes = {}
            for name in ("static_0", "static_3"):
                session.serve_policy(served, policies[name])
                probes[name] = prefill_probes(name)
            save("sim_prefill", {**result, "prefill": probes})
        time.sleep(4)
    finally:
        session.stop(server, "sim")
        if controller.poll() is None:
            session.stop(controller, "specctl-serve")
        save_log(RUN / "server-sim.log")
        shutil.copy(RUN / "controller.log", OUT / "offswitch_controller.log")
        if (RUN / "trace-sim").exists():  # every policy's decisions, step by step
            session.pack(RUN / "trace-sim", "offswitch_trace_sim.tar.gz")


if __name__ == "__main__":
    RUN.mkdir(parents=True, exist_ok=True)
    {"nospec": phase_nospec, "off": phase_off, "sim": phase_sim}[sys.argv[1]]()
    session.log("done")
