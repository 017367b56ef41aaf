"""Recording design for the next GPU session: the steps a load-aware cost model needs.

``record`` ran on the H200 in the eighth session (docs/FIDELITY.md "Run 12"); with
``RADIX=1`` in the ninth (run 14). Phases,
with ``offswitch.py``'s flags (``--disable-radix-cache``, ``--max-running-requests 48``,
``--context-length 4096``), writing ``$OUT/fidelity_<phase>.json`` and, where recorded,
``$OUT/fidelity_<phase>_trace.tar.gz``:

    MODELS=.h200/models      python scripts/h200/fidelity_explore.py record   # dense
    MODELS=.h200/models_moe  python scripts/h200/fidelity_explore.py record   # MoE
    python scripts/h200/fidelity_explore.py nospec    # end-to-end, server without speculation
    ACC=2.5 python scripts/h200/fidelity_explore.py holdout   # end-to-end, per policy

* ``record``: EAGLE-3 + plugin in record-explore mode (every candidate depth 0, 1, 3, 5 at
  every load, dwell 4; depth 0 is the plugin's off path = plain decode):
  - **KV apart from batch**: one batch of C requests for every C in {1, 8, 32, 48} and
    prompt length in {64, 512, 1536, 3584} (128 output tokens), so the cached tokens per
    step range from 64 to 48 x 3,712 (near the context limit) at every batch size;
  - **prefill sizes, alone and mixed with decode**: single prompts of
    {16, 64, 256, 512, 1024, 2048, 3968} tokens, sent while a background batch of
    B in {0, 16, 40} long-output requests decodes;
  - **state after a prefill** (the MoE's 1.14-1.54x slower speculative steps until a steps-0
    step ran): the same background batches with one 256-token prompt every 0.5 s.
  - **prefill after a cached prefix** (``RADIX=1`` only: the server keeps SGLang's radix
    cache): a prefix of P in {512, 1536, 2560} tokens is sent alone (its prefill caches
    it), then the prefix with N in {64, 512, 1024} new tokens of its own, alone and under a
    background batch of 16; and 8 prompts at once sharing a cached 2,560-token prefix with
    512 tokens each of their own. The plugin records each step's attention pairs
    (``prefill_pairs``), so ``env.sim.prefill_fit`` takes these steps as they are.

  - **small batches** (``small_batch``, not in the default sections): a closed loop of C
    clients for each C in 1..7 (256-token prompts, 128 output tokens, 6 s each), the
    decode batches between the record's 1, 8, 16 and 48, where the MoE profile prices the
    off path 14-26% under the records (``docs/FIDELITY.md`` run 14).

``SECTIONS`` (comma-separated; default ``kv_grid,prefill,state``, and ``prefix`` with
``RADIX=1``) picks what ``record`` runs.
* ``nospec``: a server without speculation, the same record-free workloads end to end
  (the plugin records only on speculative servers, so its steps are the off path's).
* ``holdout``: end-to-end runs never used by a fit: the 40 s headline at two fresh seeds and
  closed loops C = 1, 16, 64 for 10 s each, per policy (``POLICIES``, default
  static_0, static_3, ppo) with ``SGLANG_SIMULATE_ACC_LEN=$ACC``.

Every request gets fresh prompt ids (a seed never used before in this session, from
``SEEDS``), so even a server with the radix cache on could not hit earlier prompts.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import loadgen
import offswitch
import session

URL, RUN = session.URL, session.RUN
CONCURRENCY = [1, 8, 32, 48]
PROMPTS = [64, 512, 1536, 3584]  # + 128 output tokens stays under --context-length 4096
PREFILLS = [16, 64, 256, 512, 1024, 2048, 3968]
BACKGROUND = [int(b) for b in os.environ.get("BACKGROUND", "0,16,40").split(",")]
#: Output tokens of a background request: long enough to outlast the probe, short enough
#: that the closed loop's drain (it waits for its last answer) costs seconds, not tens.
BACKGROUND_OUTPUT = 512
#: Seconds the phase may use after its server is up; probes past it are skipped (and
#: named in the output), so a call's time limit never loses what was measured.
BUDGET_S = float(os.environ.get("BUDGET_S", "1e9"))
#: ``RADIX=1``: the record's server keeps the radix cache (the ``prefix`` section needs it).
RADIX = os.environ.get("RADIX", "0") == "1"
SECTIONS = os.environ.get("SECTIONS", "kv_grid,prefill,state" + (",prefix" if RADIX else "")
                          ).split(",")
CACHED_PREFIXES = [512, 1536, 2560]
NEW_AFTER_PREFIX = [64, 512, 1024]  # 2,560 + 1,024 + 8 output tokens < 4,096
#: One fresh seed per request batch: prompt ids are drawn from it (loadgen).
SEEDS = itertools.count(int(os.environ.get("SEED0", "10000")))


def with_background(batch: int, seconds: float, work) -> dict:
    """Run ``work()`` while ``batch`` closed-loop clients of long outputs decode."""
    result: dict = {}
    if batch:
        thread = threading.Thread(target=lambda: result.update(background=loadgen.closed_loop(
            URL, batch, seconds, prompt=256, output=BACKGROUND_OUTPUT, seed=next(SEEDS))))
        thread.start()
        time.sleep(1.0)  # the background batch is decoding before the probe starts
    result["probe"] = work()
    if batch:
        thread.join()
    return result


def random_ids(tokens: int) -> list[int]:
    """``tokens`` prompt ids from a fresh seed (ids never sent before in this session)."""
    rng = random.Random(next(SEEDS))
    return [rng.randrange(1000, 100_000) for _ in range(tokens)]


def after_prefix(prefix_tokens: int, new_tokens: int, requests: int = 1) -> dict:
    """Cache a prefix of ``prefix_tokens`` (sent alone, one output token), then send
    ``requests`` prompts at once of that prefix and ``new_tokens`` of their own each."""
    prefix = random_ids(prefix_tokens)
    warm = loadgen.replay(URL, [0.0], [prefix_tokens], [1], prompt_ids=[prefix])
    prompts = [prefix + random_ids(new_tokens) for _ in range(requests)]
    probe = loadgen.replay(URL, [0.0] * requests, [len(p) for p in prompts], [8] * requests,
                           prompt_ids=prompts)
    return {"warm": warm, "probe": probe}


def phase_record() -> None:
    if "prefix" in SECTIONS and not RADIX:
        raise SystemExit("SECTIONS includes prefix, which needs RADIX=1 (the radix cache on)")
    session.CANDIDATES = offswitch.CANDIDATES
    env = {**offswitch.plugin_env("trace-fidelity"), "SPECCTL_RECORD_EXPLORE": "1",
           "SPECCTL_EXPLORE_DWELL": "4",  # no controller runs: every rank explores
           # The held-out runs' acceptance and real tokens (an MoE's routing follows them).
           "SGLANG_SIMULATE_ACC_LEN": offswitch.ACC,
           "SGLANG_SIMULATE_ACC_TOKEN_MODE": offswitch.TOKEN_MODE}
    server = offswitch.start("record", spec=True, env=env, radix_cache=RADIX)
    suffix = "_radix" if RADIX else ""
    name = f"fidelity_record_{offswitch.MODELS.name}{suffix}.json"
    out: dict = {"model": offswitch.MODELS.name, "acceptance": float(offswitch.ACC),
                 "radix_cache": RADIX, "sections": SECTIONS,
                 "kv_grid": {}, "prefill": {}, "state": {}, "prefix": {}, "small_batch": {},
                 "skipped": []}
    deadline = time.time() + BUDGET_S

    def probe(section: str, key: str, work) -> None:
        if section not in SECTIONS:
            return
        if time.time() > deadline:
            out["skipped"].append(f"{section}/{key}")
            return
        out[section][key] = work()
        session.save(name, out)  # after every probe: a cut-off call keeps what ran

    try:
        for prompt, c in itertools.product(PROMPTS, CONCURRENCY):
            probe("kv_grid", f"{prompt}x{c}", lambda c=c, p=prompt: loadgen.one_batch(
                URL, c, prompt=p, output=128, seed=next(SEEDS)))
        for batch, length in itertools.product(BACKGROUND, PREFILLS):
            probe("prefill", f"{length}@{batch}", lambda b=batch, n=length: with_background(
                b, 4.0, lambda: loadgen.one_batch(URL, 1, prompt=n, output=8, seed=next(SEEDS))))
        arrivals = [0.5 * i for i in range(12)]
        for batch in [b for b in BACKGROUND if b]:
            probe("state", str(batch), lambda b=batch: with_background(b, 8.0, lambda: (
                loadgen.replay(URL, arrivals, [256] * len(arrivals), [8] * len(arrivals),
                               seed=next(SEEDS)))))
        for prefix, new, batch in itertools.product(CACHED_PREFIXES, NEW_AFTER_PREFIX, (0, 16)):
            probe("prefix", f"{prefix}+{new}@{batch}", lambda p=prefix, n=new, b=batch: (
                with_background(b, 4.0, lambda: after_prefix(p, n))))
        probe("prefix", "2560+512x8", lambda: after_prefix(2560, 512, requests=8))
        for c in range(1, 8):
            probe("small_batch", str(c), lambda c=c: loadgen.closed_loop(
                URL, c, 6.0, prompt=256, output=128, seed=next(SEEDS)))
        session.save(name, out)
    finally:
        session.stop(server, "record")
        if (RUN / "trace-fidelity").exists():
            session.pack(RUN / "trace-fidelity",
                         f"fidelity_record_{offswitch.MODELS.name}{suffix}_trace.tar.gz")


def end_to_end() -> dict:
    arrivals, prompts, outputs = session.headline_workload()
    result = {f"headline_seed{s}": loadgen.replay(URL, arrivals, prompts, outputs, seed=s)
              for s in (next(SEEDS), next(SEEDS))}
    for c in (1, 16, 64):
        result[f"closed_{c}"] = loadgen.closed_loop(URL, c, 10.0, seed=next(SEEDS))
    return result


def phase_nospec() -> None:
    server = offswitch.start("nospec", spec=False, env={})
    try:
        session.save(f"fidelity_nospec_{offswitch.MODELS.name}.json",
                     {"model": offswitch.MODELS.name, **end_to_end()})
    finally:
        session.stop(server, "nospec")


def phase_holdout() -> None:
    session.CANDIDATES = offswitch.CANDIDATES
    policies = session.write_policies()
    served = RUN / "policy.npz"
    shutil.copy(policies["static_3"], served)
    controller = session.start_controller(served, "h200_llama31_8b_recorded")
    env = {**offswitch.plugin_env("trace-holdout"), "SGLANG_SIMULATE_ACC_LEN": offswitch.ACC}
    server = offswitch.start("holdout", spec=True, env=env)
    out: dict = {"model": offswitch.MODELS.name, "acceptance": float(offswitch.ACC)}
    try:
        for name in os.environ.get("POLICIES", "static_0,static_3,ppo").split(","):
            session.serve_policy(served, policies[name])
            out[name] = end_to_end()
            session.save(f"fidelity_holdout_{offswitch.MODELS.name}.json", out)
    finally:
        session.stop(server, "holdout")
        session.stop(controller, "specctl-serve")


if __name__ == "__main__":
    RUN.mkdir(parents=True, exist_ok=True)
    {"record": phase_record, "nospec": phase_nospec, "holdout": phase_holdout}[sys.argv[1]]()
    print(json.dumps({"done": sys.argv[1]}))
