#!/bin/bash
# specctl-eval on the GPU's dense server at acceptance 3.0 (docs/results/gpu22/README.md):
#   bash docs/results/gpu22/eval_dense30.sh LABEL SERVER_YAML POLICY SEED
# e.g. after_old docs/results/gpu22/dense_spec_launch.yaml docs/results/off_probe/policy_3dd256a8.npz 0
# (before: docs/results/h200/fidelity/dense_spec.yaml); results in /tmp/g22/d30_LABEL_sSEED.
cd "$(dirname "$0")/../../.."
LABEL=$1; SERVER=$2; POL=$3; SEED=$4
PYTHONPATH=$PWD nice -n 5 python -m agents.evaluate seed=$SEED eval.workers=1 policy=$POL \
  "eval.families=[{profile: $SERVER, label: h200_dense_acc3.0, acceptance: {model: sglang_simulated, mean_accept_length: 3.0}}]" \
  'eval.prior_modes=[exact]' eval.random_servers=0 'eval.held_out_families=[]' 'eval.held_out_workloads=[]' \
  'eval.workloads=[{name: azure_conv, kind: open, load: [0.5, 1.0, 1.5], modulate_depth: [0.0, 0.8]}, {name: fixed, kind: closed, concurrency: [1, 16, 48, 64]}]' \
  'eval.policies=[no_spec,static_3,oracle,ppo]' 'eval.sweep_policies=[no_spec,ppo]' \
  'eval.sweep_concurrency=[48]' eval.policy_map=false eval.windows=2 \
  hydra.run.dir=/tmp/g22/d30_${LABEL}_s$SEED
