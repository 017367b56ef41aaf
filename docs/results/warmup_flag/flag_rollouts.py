"""Usage: PYTHONPATH=$PWD python docs/results/warmup_flag/flag_rollouts.py

The same policy files read the warm-up by inference or from the records' flag
(``dataclasses.replace`` of their feature spec with ``warmup_flag=True``), in the
simulator with the plugin's warm-up: closed loops on the dense H200 (the probe case of
``tests/test_probe.py``, 64 clients) and the MoE, 6 s each, three seeds. Prints decisions,
the share decided off, warm-ups, and throughput."""
import dataclasses

from agents.policies import ExportedPolicyAdapter
from controller.policy_file import ExportedPolicy
from env.rollout import DecisionLoop, rollout
from env.sim.acceptance import SGLangSimulatedAcceptance
from env.sim.cost_model import load_profile
from env.sim.simulator import SchedulerConfig, Simulator
from env.traces.workloads import ClosedLoop

FILES = {"58513820": "docs/results/drop_warmup/policy_58513820.npz",
         "9505319e": "docs/results/drop_warmup/policy_9505319e.npz"}
CASES = [("h200_llama31_8b", 64, 48), ("h200_llama31_8b", 16, 48),
         ("h200_qwen3_30b_a3b", 32, 64)]

for name, path in FILES.items():
    base = ExportedPolicy.load(path)
    for flag in (False, True):
        policy = dataclasses.replace(base, feature_spec=dataclasses.replace(
            base.feature_spec, warmup_flag=flag))
        for profile_name, clients, running in CASES:
            profile = load_profile(profile_name)
            for seed in (5, 6, 7):
                sim = Simulator(profile, SGLangSimulatedAcceptance(3.5),
                                ClosedLoop(clients, 256, 256),
                                SchedulerConfig(max_running_requests=running,
                                                reentry_warmup=True), seed=seed)
                loop = DecisionLoop(sim, policy.feature_spec, feedback_lag=3, horizon_s=6.0,
                                    cost_prior=profile)
                r = rollout(loop, ExportedPolicyAdapter(policy), seed=seed)
                off = r.steps_chosen[0] / max(r.decisions, 1)
                print(f"{name} warmup_flag={flag!s:5} {profile_name} C={clients} seed={seed}: "
                      f"{r.decisions} decisions, off {off:.3f}, warm-ups {r.warmups}, "
                      f"{r.throughput_tok_s:.0f} tok/s", flush=True)
