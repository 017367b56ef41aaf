"""Measured cells of any recorded H200 run directory, in one flat form.

A *cell* is one end-to-end measurement: a model, a server configuration, an acceptance, a
workload, a policy, and the measured output throughput and mean TPOT. The three layouts
the project's sessions have written are recognised by file name and keys:

* ``offswitch.py`` (``docs/results/h200/offswitch``): ``<model>_nospec*.json`` (a server
  without speculation: ``sweep``, ``headline``), ``<model>_off*.json`` (the plugin's off
  path under a constant steps-0 policy: ``sweep_off``, ``headline_off``; ``sweep_switching``
  runs the explore rule and is skipped), ``<model>_acc<A>_replay.json``
  (``headline_<policy>`` at simulated acceptance A; ``_replay_run<N>.json`` for later
  runs, ``_replay_<tag>.json`` / ``_replay_<tag>_run<N>.json`` for a variant such as
  ``realtokens``; the file's ``simulate_acc_token_mode`` says which tokens it decoded,
  SGLang's default ``fixed`` when absent). Every server with ``--disable-radix-cache``,
  ``--max-running-requests 48``, 40 s headline. A sweep repeated at one C (keys ``C``,
  ``C#1``, ``C#2``, ...; run 3) is one cell: the median of the repeats per metric (the
  first run at a C can be an outlier: the dense off path's first C = 48 run, 8.20 ms
  against 6.71 / 6.70).
* ``load_cells.py`` (``docs/results/h200/load``, run 6): ``<model>_nospec_run<N>.json``
  with ``closed`` (``{C: summary}``), ``<model>_acc<A>_load_run<N>.json`` with
  ``closed_<policy>`` (the plugin's policies; a policy served again on the same server
  adds ``repeat_closed_<policy>``, ``repeat3_closed_<policy>``, ...: cells of a later
  ``serving``), ``<model>_acc<A>_sglang_run<N>.json``
  (SGLang's own ``--speculative-adaptive``, no plugin: ``headline_sglang_adaptive``,
  ``closed_sglang_adaptive``); closed loops of ``closed_seconds``, the servers as above.
* ``load_cells.py prefix``: ``<model>_prefix_run<N>.json``, a server without speculation
  with the radix cache **on**: ``unique_prefix`` and ``shared_prefix``, open-loop replays
  of ``prefix_workload.py`` (the same arrivals and lengths, prompts all their own or
  sharing group prefixes).
* ``session.py`` (``docs/results/h200``): ``sweep_real.json`` (``{policy: {C: ...}}``,
  one batch), ``headline_real.json`` / ``headline_static3.json`` / ``headline_sglang.json``
  (``{policy: ...}``), dense, acceptance 3.5, radix cache on, SGLang's own steps=0.
* ``run_phases.py`` (``shared/measured/h200-sglang-0.5.15-offswitch/results``):
  ``moe_acc<AA>_closed.json`` (5 s closed loops), ``moe_acc<AA>_headline.json``,
  ``*_nospec_server*.json``; radix cache on, ``--max-running-requests 64``.

Unknown files are listed in ``skipped`` with the reason, never silently dropped.

Each cell also says which tokens its server decoded (``tokens``) and, where its
configuration is no longer the one the project measures, why it is reported apart
(``apart``, one of ``APART``'s keys; :func:`apart_reason`).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

#: Server kinds: no speculation at all; speculation with the plugin's off path
#: (steps 0 = plain decode); speculation with SGLang's own steps=0 (the old plugin).
SERVERS = ("nospec", "spec_off", "spec_sglang0")
#: What the generated tokens were: ``real`` (the target's own greedy tokens, and with
#: ``SGLANG_SIMULATE_ACC_TOKEN_MODE=real-draft-token`` the draft chain's accepted ones) or
#: ``token100`` (SGLang 0.5.15's default simulated-acceptance mode writes id 100 for every
#: generated token; on the random-weight MoE that collapses the expert routing).
TOKEN_MODES = {"fixed": "token100", "real-draft-token": "real"}
#: The steps every speculative server of ``offswitch.py`` (and ``load_cells.py``, which
#: starts its servers through it) offered the controller: its ``CANDIDATES``, the
#: adaptive config's ``candidate_steps`` since its first run. The controller masks the
#: policy's other actions (``controller.decider.allowed_actions``), so the shipped file's
#: depth 2, its first choice at most states of the MoE @ 2.5 replay, never ran there.
OFFSWITCH_CANDIDATES = (0, 1, 3, 5)
#: Why a cell is reported apart from the representative ones (docs/FIDELITY.md).
APART = {
    "token-100": "MoE run with SGLang's default simulated-acceptance tokens (id 100 for "
                 "every token): its expert routing, hence every step cost, is not real text's",
    "first off path": "the off path's first version (runs 1-2, commit 81e6690), replaced in "
                      "run 3: 3-17% slower than no speculation at C = 32/48 (OFFSWITCH.md)",
    "radix on": "radix cache on with prompt ids reused across runs (prefix-cache hits the "
                "simulator does not model) and SGLang's own steps=0 instead of the off path",
    "policy gone": "the policy that ran is not recorded and its format no longer loads: the "
                   "simulator runs today's policy, not a replay of what ran",
    "guarded static": "a constant policy served with the goodput guard (runs 26-27), which "
                      "runs off where it prices the depth below off: not the constant depth "
                      "the simulator runs",
}
#: Open-loop replays of ``prefix_workload.py`` (``load_cells.py prefix``), radix cache on.
PREFIX_WORKLOADS = ("unique_prefix", "shared_prefix")
#: Files measured with the off path's first version (``APART["first off path"]``).
FIRST_OFF_PATH = ("dense_off_run1.json", "dense_off_run2.json", "moe_off.json",
                  "dense_acc3.5_replay.json", "moe_acc1.1_replay.json")


@dataclass(frozen=True)
class Cell:
    """One measured end-to-end result (see the module docstring)."""

    model: str  # "dense" (Llama-3.1-8B shape) or "moe" (Qwen3-30B-A3B shape)
    server: str  # one of SERVERS
    acceptance: float | None  # SGLANG_SIMULATE_ACC_LEN; None = none simulated
    workload: str  # "one_batch", "closed", "headline" or one of PREFIX_WORKLOADS
    concurrency: int | None  # C for one_batch / closed
    seconds: float | None  # closed-loop length or headline length
    policy: str
    radix_cache: bool
    max_running: int
    source: str  # file and key it came from
    throughput_tok_s: float
    mean_tpot_ms: float
    #: The cost profile the real controller was started with, where the run file names
    #: it (``profile`` of ``offswitch.py``'s replays); the PPO policy's prior.
    prior: str | None = None
    #: Which tokens the server decoded (``TOKEN_MODES``' values).
    tokens: str = "real"
    #: Why the cell is reported apart (a key of ``APART``), None for a representative cell.
    apart: str | None = None
    #: The how-many-th time this policy was served on this server (1: first); later
    #: servings are repeats of the same configuration, the run's own noise.
    serving: int = 1
    #: The sha256 of the exported policy the run's ``ppo`` cells ran (``policy_sha256`` of
    #: ``load_cells.py`` / ``offswitch.py`` files), where the file records it.
    policy_sha256: str | None = None
    #: The cell's policy is an ``EXTRA_POLICIES`` name (``offswitch.py``: a candidate file
    #: served beside the shipped one, as ``ppo`` is served): its ``policy_sha256`` and
    #: ``guard`` are its entry of the run file's ``extra_policies``.
    extra_policy: bool = False
    #: The goodput guard the run's ``ppo`` cells were served with (``guard`` of
    #: ``load_cells.py`` files since the eleventh session: the policy file's
    #: :class:`env.guard.GuardSpec` as a mapping); None where the file does not record it:
    #: every run before the guard existed (runs 1-25), served without it.
    guard: dict | None = None
    #: A closed loop's output tokens within its sending window per second
    #: (:func:`window_throughput`), where the run kept each request's times; else None.
    window_tok_s: float | None = None
    #: A replay's mean arrival rate, requests/s (a prefix replay: ``prefix_workload.RATE``
    #: where the run file does not say; a headline replay: ``headline_rate`` of
    #: ``offswitch.py``'s files, else ``session.headline_rate()``).
    rate: float | None = None
    #: The steps the server offered the controller (its speculative adaptive config's
    #: ``candidate_steps``, the HELLO's): ``candidates`` of the run file, else
    #: :data:`OFFSWITCH_CANDIDATES` for ``offswitch.py`` / ``load_cells.py`` files of a
    #: speculative server; None where not known (every depth, as simulated before).
    candidates: tuple[int, ...] | None = None

    def key(self) -> str:
        """A short unique label of the cell (without the source)."""
        load = (f"C={self.concurrency}" if self.concurrency is not None
                else f"{self.seconds:g}s")
        acc = "" if self.acceptance is None else f"@{self.acceptance:g}"
        again = f" #{self.serving}" if self.serving > 1 else ""
        rate = f" {self.rate:g}/s" if self.rate is not None else ""
        return f"{self.server}{acc} {self.workload}{rate} {load} {self.policy}{again}"

    def to_dict(self) -> dict:
        return asdict(self)


def window_throughput(first_token_s, done_s, output_tokens, seconds: float) -> float:
    """Output tokens a closed loop streamed within its sending window ``[0, seconds]``, per
    second: a request's first token at its first-token time, the others evenly until it
    was done (times from the loop's start).

    The loop's throughput (tokens over the time to its last answer) includes the drain
    after the window, whose length jumps with how many requests each client started before
    the deadline: on the MoE at C = 64, static 0 served twice on one server gave 2,352 and
    2,176 tok/s at 17.4 / 17.5 ms TPOT (256 against 209 requests). The window leaves the
    drain out.
    """
    first = np.asarray(first_token_s, dtype=float)
    done = np.asarray(done_s, dtype=float)
    tokens = np.asarray(output_tokens, dtype=float)
    if not seconds > 0:
        raise ValueError(f"a sending window must be positive, got {seconds}")
    span = np.maximum(done - first, 1e-12)
    streamed = np.where(done <= seconds, tokens,
                        np.where(first > seconds, 0.0,
                                 1.0 + (tokens - 1.0) * np.clip((seconds - first) / span, 0, 1)))
    return float(streamed.sum() / seconds)


def _model(name: str, data: dict) -> str:
    tag = str(data.get("model", ""))
    if name.startswith("moe") or tag.endswith("moe"):
        return "moe"
    return "dense"


def _cell(base: dict, result: dict, source: str, **kw) -> Cell:
    try:
        return Cell(**base, **kw, source=source,
                    throughput_tok_s=float(result["throughput_tok_s"]),
                    mean_tpot_ms=float(result["mean_tpot_ms"]))
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{source}: not a load-generator summary ({exc})") from exc


def _sweep(base: dict, sweep: dict, source: str, policy: str) -> list[Cell]:
    """One one-batch cell per C of ``sweep``; repeats (``C#k`` keys) give their median."""
    repeats: dict[int, list[dict]] = {}
    for key, r in sweep.items():
        c, _, k = key.partition("#")
        if not c.isdigit() or (k and not k.isdigit()):
            raise ValueError(f"{source}: sweep key {key!r} is not C or C#k")
        repeats.setdefault(int(c), []).append(r)
    cells = []
    for c, runs in sorted(repeats.items()):
        where = f"{source}.{c}" + (f" (median of {len(runs)})" if len(runs) > 1 else "")
        try:
            merged = {m: float(np.median([float(r[m]) for r in runs]))
                      for m in ("throughput_tok_s", "mean_tpot_ms")}
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{where}: not a load-generator summary ({exc})") from exc
        cells.append(_cell(base, merged, where, workload="one_batch", concurrency=c,
                           seconds=None, policy=policy))
    return cells


def _closed(base: dict, loops: dict, source: str, policy: str, seconds: float,
            serving: int = 1) -> list[Cell]:
    """One closed-loop cell per C of ``loops`` (``{C: summary}``)."""
    cells = []
    for c, r in loops.items():
        if not c.isdigit():
            raise ValueError(f"{source}: closed-loop key {c!r} is not a client count")
        window = None
        if r.get("per_request"):  # [sent, first token, done, output tokens] per request
            _, first, done, tokens = np.asarray(r["per_request"], dtype=float).T
            window = window_throughput(first, done, tokens, seconds)
        cells.append(_cell(base, r, f"{source}.{c}", workload="closed", concurrency=int(c),
                           seconds=seconds, policy=policy, serving=serving,
                           window_tok_s=window))
    return cells


#: ``closed_<policy>``, ``repeat_closed_<policy>`` (second serving) or
#: ``repeat<k>_closed_<policy>`` (k-th): ``load_cells.loop_key``.
CLOSED_KEY = re.compile(r"(?:repeat(\d*)_)?closed_(.+)")


def _serving(key: str, source: str) -> tuple[str, int] | None:
    """(policy, serving) of a closed-loop key, or None if ``key`` is not one."""
    match = CLOSED_KEY.fullmatch(key)
    if match is None or key == "closed_seconds":
        return None
    if not key.startswith("repeat"):
        return match[2], 1
    serving = int(match[1] or 2)
    if serving < 2:
        raise ValueError(f"{source}: key {key!r}: a repeat is serving 2 or later")
    return match[2], serving


#: ``offswitch.py``'s replay at one of ``HEADLINE_RATES`` (``_r8``; its second at that rate
#: ``_r8_2``), before a docs copy's ``_runN``.
RATE_SUFFIX = r"(_r[\d.]+(_\d+)?)?"


def _offswitch(path: Path, data: dict) -> list[Cell]:
    name = path.name
    model = _model(name, data)
    # The replay's mean arrival rate where the file records it (HEADLINE_RATES); else the
    # default rate of session.headline_workload.
    rate = float(data["headline_rate"]) if "headline_rate" in data else None
    common = {"model": model, "radix_cache": False, "max_running": 48, "rate": rate}
    seconds = float(data.get("closed_seconds", 10.0))
    cells = []
    if "_nospec" in name:
        base = {**common, "server": "nospec", "acceptance": None}
        cells += _sweep(base, data.get("sweep", {}), f"{name}:sweep", "no_spec")
        cells += _closed(base, data.get("closed", {}), f"{name}:closed", "no_spec", seconds)
        if "headline" in data:
            cells.append(_cell(base, data["headline"], f"{name}:headline", workload="headline",
                               concurrency=None, seconds=40.0, policy="no_spec"))
    elif "_off" in name:
        base = {**common, "server": "spec_off", "acceptance": None}
        cells += _sweep(base, data.get("sweep_off", {}), f"{name}:sweep_off", "static_0")
        if "headline_off" in data:
            cells.append(_cell(base, data["headline_off"], f"{name}:headline_off",
                               workload="headline", concurrency=None, seconds=40.0,
                               policy="static_0"))
    elif re.search(rf"_(replay(_[a-z]+)?|load|sglang){RATE_SUFFIX}(_run\d+)?\.json$", name):
        mode = data.get("simulate_acc_token_mode", "fixed")
        if mode not in TOKEN_MODES:
            raise ValueError(f"{name}: simulate_acc_token_mode {mode!r} is not one of "
                             f"{sorted(TOKEN_MODES)}")
        # SGLang's own rule runs without the plugin: its steps=0 is SGLang's.
        server = "spec_sglang0" if "_sglang" in name else "spec_off"
        base = {**common, "server": server, "acceptance": float(data["acceptance"]),
                "prior": data.get("profile"), "tokens": TOKEN_MODES[mode],
                "policy_sha256": data.get("policy_sha256"), "guard": data.get("guard"),
                # the plugin's servers' (SGLang's own rule ran its own config, no ppo)
                "candidates": (tuple(data.get("candidates") or OFFSWITCH_CANDIDATES)
                               if server == "spec_off" else None)}
        extra = data.get("extra_policies") or {}
        for key, r in data.items():
            if key.startswith("headline_") and key != "headline_rate":
                policy = key[len("headline_"):]
                cells.append(_cell(_served_as(base, extra, policy), r, f"{name}:{key}",
                                   workload="headline", concurrency=None, seconds=40.0,
                                   policy=policy))
            elif (served := _serving(key, name)) is not None:
                policy, serving = served
                cells += _closed(_served_as(base, extra, policy), r, f"{name}:{key}", policy,
                                 seconds, serving=serving)
    return cells


def _served_as(base: dict, extra: dict, policy: str) -> dict:
    """``base`` for a cell of ``policy``: an ``EXTRA_POLICIES`` name's file and guard from
    the run file's ``extra_policies`` entry (``session.served_policy``)."""
    if policy not in extra:
        return base
    entry = extra[policy]
    return {**base, "policy_sha256": entry["policy_sha256"], "guard": entry["guard"],
            "extra_policy": True}


def plugin_servings(path: str | Path) -> tuple[float, list[list[str]]] | None:
    """How a ``load_cells.py plugin`` file's closed loops ran on its one server: the
    warm-up loop's seconds (``warmup_seconds``; 0 where the file has none) and, per serving
    in the order served, the sources of its loops (``Cell.source``) in the order run.
    None for any other file. On the server one controller stream saw every loop of the
    file, so a replay that carries its state from loop to loop follows this order."""
    path = Path(path)
    if not re.search(r"_load(_run\d+)?\.json$", path.name):
        return None
    data = json.loads(path.read_text())
    servings = [[f"{path.name}:{key}.{c}" for c in loops]
                for key, loops in data.items() if _serving(key, path.name) is not None]
    return (float(data.get("warmup_seconds", 0.0)), servings) if servings else None


def _prefix(path: Path, data: dict) -> list[Cell]:
    base = {"model": _model(path.name, data), "server": "nospec", "acceptance": None,
            "radix_cache": bool(data.get("radix_cache", True)), "max_running": 48,
            "concurrency": None, "policy": "no_spec"}
    try:
        seconds = float(data["seconds"])
        rate = float(data["rate"]) if "rate" in data else None
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path.name}: needs the replay's seconds and a numeric rate "
                         f"({exc})") from exc
    return [_cell(base, data[w], f"{path.name}:{w}", workload=w, seconds=seconds, rate=rate)
            for w in PREFIX_WORKLOADS if w in data]


def _session(path: Path, data: dict) -> list[Cell]:
    base = {"model": "dense", "server": "spec_sglang0", "acceptance": 3.5, "radix_cache": True,
            "max_running": 48, "tokens": "token100"}
    name = path.name
    cells = []
    if name == "sweep_real.json":
        for policy, per_c in data.items():
            for c, r in per_c.items():
                if c.isdigit():
                    cells.append(_cell(base, r, f"{name}:{policy}.{c}", workload="one_batch",
                                       concurrency=int(c), seconds=None, policy=policy))
    else:
        for policy, r in data.items():
            if policy != "workload":
                cells.append(_cell(base, r, f"{name}:{policy}", workload="headline",
                                   concurrency=None, seconds=40.0, policy=policy))
    return cells


def _phases(path: Path, data: dict) -> list[Cell]:
    name = path.name
    match = re.match(r"moe_acc(\d)(\d)_(closed|headline)\.json$", name)
    common = {"model": _model(name, data), "radix_cache": True, "max_running": 64}
    cells = []
    if match:
        acc = float(f"{match[1]}.{match[2]}")
        base = {**common, "server": "spec_sglang0", "acceptance": acc, "tokens": "token100"}
        # acceptance 1.1 headlines were 30 s (585 requests), 2.5 ones 40 s
        seconds = 30.0 if acc < 2 else 40.0
        for policy, r in data.items():
            if match[3] == "closed":
                for c, rc in r.items():
                    cells.append(_cell(base, rc, f"{name}:{policy}.{c}", workload="closed",
                                       concurrency=int(c), seconds=5.0, policy=policy))
            else:
                cells.append(_cell(base, r, f"{name}:{policy}", workload="headline",
                                   concurrency=None, seconds=seconds, policy=policy))
    elif "nospec_server" in name:
        base = {**common, "server": "nospec", "acceptance": None}
        if name.startswith("dense"):
            base["max_running"] = 48
        for key, r in data.items():
            if key.isdigit():
                cells.append(_cell(base, r, f"{name}:{key}", workload="one_batch"
                                   if name.startswith("dense") else "closed",
                                   concurrency=int(key),
                                   seconds=None if name.startswith("dense") else 5.0,
                                   policy="no_spec"))
    return cells


def apart_reason(cell: Cell, data: dict) -> str | None:
    """Why ``cell`` (read from a file holding ``data``) is reported apart, or None.

    The first matching reason of ``APART``, in its order: MoE token-100 runs, the first
    version's off path (cells that can run an off step), the radix-cache-on runs, PPO
    cells whose policy is not recorded (``policy_sha256``), constant policies served with
    the goodput guard (files that record the PPO policy's ``guard`` but not
    ``static_guard``).
    """
    file = cell.source.split(":")[0]
    if cell.model == "moe" and cell.tokens == "token100":
        return "token-100"
    if file in FIRST_OFF_PATH and cell.server == "spec_off" and cell.policy != "static_3":
        return "first off path"
    if cell.radix_cache and cell.workload not in PREFIX_WORKLOADS:
        return "radix on"
    if cell.policy == "ppo" and "policy_sha256" not in data:
        return "policy gone"
    if cell.policy.startswith("static_") and "guard" in data and "static_guard" not in data:
        return "guarded static"
    return None


def read_run_dir(folder: str | Path) -> tuple[list[Cell], dict[str, str]]:
    """Every recognised cell under ``folder`` and, per skipped JSON file, why."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"run directory {folder} does not exist")
    cells: list[Cell] = []
    skipped: dict[str, str] = {}
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: invalid JSON at line {exc.lineno}: {exc.msg}") from exc
        name = path.name
        if re.match(r"(dense|moe)_(nospec(_replay)?|off|acc[\d.]+_(replay(_[a-z]+)?|load|sglang))"
                    rf"{RATE_SUFFIX}(_run\d+)?\.json$", name):
            found = _offswitch(path, data)
        elif re.match(r"(dense|moe)_prefix(_run\d+)?\.json$", name):
            found = _prefix(path, data)
        elif name in ("sweep_real.json", "headline_real.json", "headline_static3.json",
                      "headline_sglang.json"):
            found = _session(path, data)
        elif name.startswith("moe_acc") or "nospec_server" in name:
            found = _phases(path, data)
        else:
            found = []
        if found:
            cells += [replace(c, apart=apart_reason(c, data)) for c in found]
        else:
            skipped[name] = "no recognised layout (see scripts/h200/measured_runs.py)"
    return cells, skipped
