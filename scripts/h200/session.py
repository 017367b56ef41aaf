"""Phases of the end-to-end run on the H200 machine (see docs/H200.md).

Each phase starts what it needs (SGLang server with the specctl plugin, ``specctl-serve``),
drives load with :mod:`loadgen`, stops everything and writes its results into ``$OUT``:

    python scripts/h200/session.py explore   # record mode, exploring every depth, C = 1..64
    python scripts/h200/session.py main      # controller: fidelity sweep, headline replay
    python scripts/h200/session.py plain     # no plugin: SGLang's own rule; static 3, plugin off

Everything runs with ``SGLANG_SIMULATE_ACC_LEN=3.5`` (random weights accept nothing).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loadgen

REPO = Path(__file__).resolve().parents[2]
RUN = Path("/tmp/run")
OUT = Path(os.environ.get("OUT", "/tmp/out"))
MODELS = REPO / ".h200" / "models"
PORT = 30000
URL = f"http://127.0.0.1:{PORT}"
SOCKET = f"ipc://{RUN}/specctl.sock"
CANDIDATES = [0, 1, 2, 3, 5, 7]
CONCURRENCY = [1, 8, 32, 48]  # the device budget allows a few; 48 = the server's batch cap


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def adaptive_config() -> Path:
    """Every candidate depth at every batch size (SGLang's --speculative-adaptive-config)."""
    path = RUN / "adaptive.json"
    path.write_text(json.dumps({"1": {"candidate_steps": CANDIDATES}}))
    return path


def start_server(name: str, plugin_env: dict[str, str], adaptive: bool = True,
                 steps: int = max(CANDIDATES), sglang_default_config: bool = False
                 ) -> subprocess.Popen:
    # Real tokens (not SGLang's default of id 100 for every generated token, which makes
    # an MoE's steps cheap): docs/OFFSWITCH.md.
    env = {**os.environ, "SGLANG_SIMULATE_ACC_LEN": "3.5",
           "SGLANG_SIMULATE_ACC_TOKEN_MODE": "real-draft-token", **plugin_env}
    args = [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(MODELS / "target"),
        "--speculative-draft-model-path", str(MODELS / "draft"),
        "--load-format", "dummy", "--skip-tokenizer-init",
        "--speculative-algorithm", "EAGLE3", "--speculative-eagle-topk", "1",
        "--speculative-num-steps", str(steps), "--speculative-num-draft-tokens", str(steps + 1),
        "--attention-backend", "triton", "--sampling-backend", "pytorch",
        "--cuda-graph-max-bs", "64", "--context-length", "4096",
        "--mem-fraction-static", "0.8", "--port", str(PORT), "--log-level", "info",
    ]
    if adaptive:
        args += ["--speculative-adaptive"]
        if not sglang_default_config:
            args += ["--speculative-adaptive-config", str(adaptive_config())]
    logfile = open(RUN / f"server-{name}.log", "w")  # noqa: SIM115 - lives with the process
    log(f"starting SGLang ({name})")
    process = subprocess.Popen(args, env=env, stdout=logfile, stderr=subprocess.STDOUT,
                               start_new_session=True)
    deadline = time.time() + 420
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"SGLang ({name}) exited: see {logfile.name}\n"
                               + Path(logfile.name).read_text()[-4000:])
        try:
            with urllib.request.urlopen(f"{URL}/health", timeout=2) as r:
                if r.status == 200:
                    log(f"SGLang ({name}) ready")
                    loadgen.one_batch(URL, 2, output=16)  # warm-up
                    return process
        except OSError:
            pass
        time.sleep(2)
    raise RuntimeError(f"SGLang ({name}) not ready in time")


def stop(process: subprocess.Popen, name: str) -> None:
    log(f"stopping {name}")
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


def start_controller(policy: Path, profile: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "controller.cli", f"policy={policy}", f"profile={profile}",
            f"endpoint={SOCKET}", "reload_poll_s=0.2", "log_every_s=10"]
    # More Hydra overrides for specctl-serve (space-separated), e.g. to A/B an option of the
    # controller's on one server start.
    args += os.environ.get("SPECCTL_SERVE_OVERRIDES", "").split()
    logfile = open(RUN / "controller.log", "a")  # noqa: SIM115
    process = subprocess.Popen(args, stdout=logfile, stderr=subprocess.STDOUT,
                               start_new_session=True, cwd=REPO)
    time.sleep(3)
    if process.poll() is not None:
        raise RuntimeError("specctl-serve exited:\n" + (RUN / "controller.log").read_text()[-3000:])
    return process


def served_policy(path: Path) -> dict:
    """What a run file records of the PPO policy ``specctl-serve`` serves from ``path``: its
    sha256, and its goodput guard as served (the file's, with ``SPECCTL_SERVE_OVERRIDES``'
    ``guard.*`` applied), which ``compare.py`` replays it with."""
    from omegaconf import OmegaConf

    from controller.policy_file import ExportedPolicy
    from env.guard import NO_GUARD

    dotlist = [item.lstrip("+") for item in os.environ.get("SPECCTL_SERVE_OVERRIDES", "").split()]
    overrides = OmegaConf.to_container(OmegaConf.from_dotlist(dotlist))
    guard = ExportedPolicy.load(path).guard.override(overrides.get("guard"))
    # The constant policies (write_policies) run without the guard, whatever the overrides:
    # runs 26-27 served them with the default guard, which turned MoE@1.1's static_1 off.
    return {"policy_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            "guard": guard.to_dict(), "static_guard": NO_GUARD.to_dict()}


def write_policies() -> dict[str, Path]:
    """Constant policies for each candidate depth (without the acceptance probe and the
    goodput guard: a constant depth is what they measure), the shipped PPO policy (its file
    sets no probe: the default, on), ``ppo_noprobe``: the same policy with the probe off,
    and ``ppo_noguard``: with its goodput guard off, each for an A/B on one server; and
    ``EXTRA_POLICIES`` (``name=path,...``, paths from the repository root): other policy
    files to serve by name, e.g. a candidate against the shipped one."""
    import dataclasses

    from controller.default_policy import default_policy_path
    from controller.policy_file import ExportedPolicy
    from env.features import FeatureSpec
    from env.guard import NO_GUARD
    from env.probe import NO_PROBE

    folder = RUN / "policies"
    folder.mkdir(parents=True, exist_ok=True)
    spec = FeatureSpec()
    paths = {}
    for steps in CANDIDATES:
        bias = np.full(spec.max_depth + 1, -1.0, np.float32)
        bias[steps] = 1.0
        ExportedPolicy([np.zeros((spec.size, spec.max_depth + 1), np.float32)], [bias],
                       list(range(spec.max_depth + 1)), spec,
                       name=f"static_{steps}", probe=NO_PROBE,
                       guard=NO_GUARD).save(folder / f"static_{steps}.npz")
        paths[f"static_{steps}"] = folder / f"static_{steps}.npz"
    shutil.copy(default_policy_path(), folder / "ppo.npz")
    paths["ppo"] = folder / "ppo.npz"
    shipped = ExportedPolicy.load(default_policy_path())
    for name, rule in (("ppo_noprobe", {"probe": NO_PROBE}), ("ppo_noguard", {"guard": NO_GUARD})):
        dataclasses.replace(shipped, **rule).save(folder / f"{name}.npz")
        paths[name] = folder / f"{name}.npz"
    for name, path in extra_policies().items():
        ExportedPolicy.load(path)  # a bad file fails here, before any server starts
        shutil.copy(path, folder / f"{name}.npz")
        paths[name] = folder / f"{name}.npz"
    return paths


def extra_policies() -> dict[str, Path]:
    """``EXTRA_POLICIES=name=path,...`` as {name: path}; a malformed entry or a missing
    file names the variable and the entry."""
    value = os.environ.get("EXTRA_POLICIES", "").strip()
    extra: dict[str, Path] = {}
    for entry in filter(None, (part.strip() for part in value.split(","))):
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"EXTRA_POLICIES: {entry!r} is not name=path")
        if not Path(path).is_file():
            raise SystemExit(f"EXTRA_POLICIES: {entry!r}: no file {path}")
        extra[name] = Path(path)
    return extra


def serve_policy(served: Path, source: Path) -> None:
    """Swap the served policy file (the controller reloads it within ~0.2 s)."""
    tmp = served.with_suffix(".tmp")
    shutil.copy(source, tmp)
    os.replace(tmp, served)
    time.sleep(1.0)


#: The headline replay's mean arrival rate (requests/s): light in the troughs, beyond the
#: MoE's no-speculation capacity at the peaks (its queue never drains: TTFT 8.6 s).
HEADLINE_RATE = 15.0


def headline_rate() -> float:
    """``HEADLINE_RATE`` from the environment (a lighter replay, whose troughs drain the
    queue, where speculation pays between peaks), else :data:`HEADLINE_RATE`."""
    value = os.environ.get("HEADLINE_RATE", "")
    try:
        rate = float(value) if value else HEADLINE_RATE
    except ValueError:
        raise SystemExit(f"HEADLINE_RATE={value!r} is not a number of requests/s") from None
    if not rate > 0:
        raise SystemExit(f"HEADLINE_RATE={value!r} must be > 0")
    return rate


def headline_workload(seconds: float = 40.0, seed: int = 0, rate: float | None = None):
    """Azure conv arrivals, modulated so load rises and falls twice, at ``rate`` requests/s
    on average (default :func:`headline_rate`): the trace from the same start, compressed
    into ``seconds``."""
    from env.traces.workloads import shipped_workload

    trace = shipped_workload("azure_conv").with_output_cap(256)
    rng = np.random.default_rng(seed)
    start = float(rng.uniform(0, trace.duration_s * 0.7))
    rate = headline_rate() if rate is None else rate
    window = trace.window(start, seconds * rate / trace.mean_rate).scaled(rate / trace.mean_rate)
    window = window.modulated(period_s=seconds / 2, depth=0.9)
    keep = window.arrival_s < seconds
    return (window.arrival_s[keep].tolist(), np.minimum(window.prompt_tokens[keep], 1024).tolist(),
            window.output_tokens[keep].tolist())


def save(name: str, data: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / name).write_text(json.dumps(data, indent=2))


def fresh(folder: Path) -> Path:
    """``folder``, emptied for the server about to start. A warm machine keeps ``RUN``
    between calls: a server recording (trace or hook timing) into an earlier server's
    folder mixes both servers' files, as run 8's first traces did (docs/FIDELITY.md)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def pack(folder: Path, name: str) -> None:
    with tarfile.open(OUT / name, "w:gz") as tar:
        tar.add(folder, arcname=folder.name)


def phase_explore() -> None:
    """Record mode exploring every candidate depth at C = 1..64, then fit the profile."""
    trace_dir = fresh(RUN / "trace-explore")
    server = start_server("explore", {
        "SPECCTL_RECORD": str(trace_dir), "SPECCTL_RECORD_EXPLORE": "1",
        "SPECCTL_EXPLORE_DWELL": "4", "SPECCTL_RECORD_FLUSH_S": "2", "SPECCTL_SERVER": "h200",
    })
    results = {}
    try:
        for c in CONCURRENCY:
            results[str(c)] = loadgen.closed_loop(URL, c, seconds=7.0)
            log(f"explore C={c}: {results[str(c)]['throughput_tok_s']:.0f} tok/s")
        time.sleep(4)  # let the recorder's periodic flush write the last steps
    finally:
        stop(server, "SGLang (explore)")
    save("explore_load.json", results)
    pack(trace_dir, "trace_explore.tar.gz")
    fit = subprocess.run([sys.executable, "-m", "env.sim.fit_profile", f"trace={trace_dir}",
                          f"out={RUN / 'h200_fitted.yaml'}", "name=h200_llama31_8b"],
                         capture_output=True, text=True, cwd=REPO)
    (OUT / "fit_report.txt").write_text(fit.stdout + fit.stderr)
    if (RUN / "h200_fitted.yaml").exists():
        shutil.copy(RUN / "h200_fitted.yaml", OUT / "h200_fitted.yaml")


def phase_main() -> None:
    """Controller in the loop: fidelity sweep (static depths, PPO) and the headline replay."""
    policies = write_policies()
    served = RUN / "policy.npz"
    shutil.copy(policies["static_3"], served)
    fitted = RUN / "h200_fitted.yaml"
    profile = str(fitted) if fitted.exists() else "h200_llama31_8b"
    controller = start_controller(served, profile)
    timing = fresh(RUN / "hooks")
    server = start_server("main", {
        "SPECCTL_CONTROLLER": SOCKET, "SPECCTL_TIMEOUT_MS": "100",
        "SPECCTL_RECORD": str(fresh(RUN / "trace-main")), "SPECCTL_RECORD_FLUSH_S": "2",
        "SPECCTL_SERVER": "h200", "SPECCTL_HOOK_TIMING": str(timing / "hooks"),
    })
    sweep, headline = {}, {}
    try:
        for name in ("static_0", "static_1", "static_3", "static_7", "ppo"):
            serve_policy(served, policies[name])
            sweep[name] = {str(c): loadgen.one_batch(URL, c, seed=c) for c in CONCURRENCY}
            log(f"sweep {name}: " + " ".join(f"{c}:{v['throughput_tok_s']:.0f}"
                                            for c, v in sweep[name].items()))
        serve_policy(served, policies["static_3"])
        sweep["closed_32_static_3"] = loadgen.closed_loop(URL, 32, seconds=10.0)
        save("sweep_real.json", sweep)
        arrivals, prompts, outputs = headline_workload()
        for name in ("static_0", "ppo"):  # static 3 runs on the plugin-free server
            serve_policy(served, policies[name])
            headline[name] = loadgen.replay(URL, arrivals, prompts, outputs)
            log(f"headline {name}: {headline[name]}")
            save("headline_real.json", headline)
        save("headline_real.json", {**headline, "workload": workload_summary()})
        time.sleep(4)
    finally:
        stop(server, "SGLang (main)")
        if controller.poll() is None:
            stop(controller, "specctl-serve")
    timings = [json.loads(p.read_text()) for p in timing.glob("hooks.*.json")]
    save("hook_timing.json", {"per_process": timings})
    pack(RUN / "trace-main", "trace_main.tar.gz")
    shutil.copy(RUN / "controller.log", OUT / "controller.log")


def workload_summary() -> dict:
    arrivals, prompts, outputs = headline_workload()
    return {"requests": len(arrivals), "seconds": max(arrivals),
            "mean_prompt": float(np.mean(prompts)), "mean_output": float(np.mean(outputs))}


def phase_plain() -> None:
    """No plugin: SGLang's own --speculative-adaptive rule with its default config on the
    headline replay; then static depth 3 (the plugin-off side of the overhead comparison,
    and the headline's static-3 row)."""
    arrivals, prompts, outputs = headline_workload()
    server = start_server("sglang-adaptive", {}, sglang_default_config=True)
    try:
        result = loadgen.replay(URL, arrivals, prompts, outputs)
        log(f"headline sglang_adaptive: {result}")
        save("headline_sglang.json", {"sglang_adaptive": result, "workload": workload_summary()})
    finally:
        stop(server, "SGLang (adaptive, default config)")
    server = start_server("plain", {}, adaptive=False, steps=3)
    results = {}
    try:
        results = {str(c): loadgen.one_batch(URL, c, seed=c) for c in CONCURRENCY}
        results["closed_32"] = loadgen.closed_loop(URL, 32, seconds=10.0)
        save("plain_static3.json", results)
        result = loadgen.replay(URL, arrivals, prompts, outputs)
        log(f"headline static_3 (no plugin): {result}")
        save("headline_static3.json", {"static_3": result})
    finally:
        stop(server, "SGLang (plain)")


if __name__ == "__main__":
    RUN.mkdir(parents=True, exist_ok=True)
    {"explore": phase_explore, "main": phase_main, "plain": phase_plain}[sys.argv[1]]()
    log("done")
