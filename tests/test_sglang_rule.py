"""``SGLangAdaptivePolicy`` against SGLang's own ``AdaptiveSpeculativeParams``, step for step.

SGLang 0.5.23 (``.sglang/0.5.23``, ``scripts/install_sglang_cpu.sh``) runs in a subprocess:
it picks the depth of each step of a random batch-size and acceptance sequence and is fed
each verify as its scheduler feeds it (``on_verify_complete(num_correct_drafts_per_req,
len(batch.reqs))``, 0 per request after a step without drafts). The emulation then sees the
same steps as the simulator's records and must choose the same depth at every step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from agents.policies import SGLANG_DEFAULT_CONFIG, SGLangAdaptivePolicy, sglang_cuda_graph_bs
from env.features import FeatureBuilder
from env.traces.schema import StepRecord
from sglang_hooks.testing import write_import_stand_ins

REPO = Path(__file__).resolve().parents[1]
SGLANG = REPO / ".sglang" / "0.5.23"

# Runs inside SGLang's interpreter: argv = config JSON, CUDA-graph sizes JSON (or null),
# initial steps, seed, steps. Prints [[batch, steps, accepted...], ...].
DRIVER = """
import json, random, sys, tempfile
from sglang.srt.speculative.adaptive_spec_params import AdaptiveSpeculativeParams
config, graph_bs, initial, seed, n = json.loads(sys.argv[1]), json.loads(sys.argv[2]), \\
    int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
    json.dump(config, f)
params = AdaptiveSpeculativeParams(initial_steps=initial, cfg_path=f.name)
params.set_cuda_graph_bs(graph_bs)
rng = random.Random(seed)
steps_out = []
quality = 0.8
for i in range(n):
    if i % 150 == 0:  # acceptance drifts: the rule must follow it up and down
        quality = rng.choice([0.05, 0.5, 0.8, 0.97])
    batch = rng.choice([1, 2, 3, 5, 7, 8, 9, 15, 17, 30, 31, 33, 47, 60, 63, 64, 70])
    steps = params.get_steps_for_batch(batch)
    accepted = []
    for _ in range(batch):
        k = 0
        while k < steps and rng.random() < quality:
            k += 1
        accepted.append(k)
    params.on_verify_complete(accepted, batch)
    steps_out.append([batch, steps, *accepted])
print(json.dumps(steps_out))
"""


def sglang_choices(tmp_path: Path, config: dict, graph_bs: list[int] | None, initial: int,
                   seed: int, n: int = 1500) -> list[list[int]]:
    if not (SGLANG / "sglang").is_dir():
        pytest.skip(f"SGLang 0.5.23 is not installed in {SGLANG} "
                    "(run scripts/install_sglang_cpu.sh)")
    write_import_stand_ins(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(SGLANG)])}
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, json.dumps(config), json.dumps(graph_bs), str(initial),
         str(seed), str(n)], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def record(i: int, batch: int, steps: int, accepted: list[int]) -> StepRecord:
    """The step as the simulator records it (no accepted drafts on a step without any)."""
    drafts = np.asarray(accepted if steps else [], np.int8)
    return StepRecord(server="t", rank=0, step_index=i, time_s=float(i), batch_size=batch,
                      waiting_requests=0, running_requests=batch, kv_used_tokens=1000,
                      kv_capacity_tokens=100_000, prefill_tokens=0, steps_used=steps,
                      accepted_drafts=drafts, step_latency_s=0.01)


def emulated_choices(policy: SGLangAdaptivePolicy, steps: list[list[int]]) -> list[int]:
    chosen, previous = [], []
    for i, (batch, _, *_accepted) in enumerate(steps):
        builder = FeatureBuilder()
        builder.update_many(previous)
        chosen.append(policy.act(builder.observation(batch)))
        run_batch, run_steps, *accepted = steps[i]
        previous = [record(i, run_batch, run_steps, accepted)]
    return chosen


@pytest.mark.parametrize(("graph_bs", "seed"), [(sglang_cuda_graph_bs(64), 0), (None, 1)])
def test_default_config_matches_sglang(tmp_path, graph_bs, seed):
    steps = sglang_choices(tmp_path, SGLANG_DEFAULT_CONFIG, graph_bs, initial=7, seed=seed)
    policy = SGLangAdaptivePolicy(initial_steps=7, cuda_graph_bs=graph_bs)
    ours = emulated_choices(policy, steps)
    theirs = [s[1] for s in steps]
    assert len(set(theirs)) >= 3, "the sequence should move the rule between depths"
    mismatches = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b]
    assert not mismatches, f"first differing step {mismatches[:1]}: ours {ours[mismatches[0]]}, " \
                           f"SGLang {theirs[mismatches[0]]}"


def test_custom_config_settings_match_sglang(tmp_path):
    """Every per-bucket setting, with non-default values, and a global default entry."""
    config = {"ema_alpha": 0.3,
              "1": {"candidate_steps": [0, 2, 4, 6], "warmup_batches": 3, "update_interval": 2,
                    "down_hysteresis": -0.1, "up_hysteresis": 0.2, "ceiling_coeff": 1.5},
              "16": {"candidate_steps": [0, 1, 2], "ema_alpha": 0.5, "warmup_batches": 0,
                     "update_interval": 1}}
    steps = sglang_choices(tmp_path, config, None, initial=4, seed=2)
    ours = emulated_choices(SGLangAdaptivePolicy(config, initial_steps=4), steps)
    assert ours == [s[1] for s in steps]
