#!/bin/bash
# The H200 headline replay of runs 56-68 (dense, acceptance 3.0, 12 and 8 requests/s) in the
# simulator, on the GPU server's fitted profile without ("before": dense_spec.yaml) and with
# ("after": dense_spec_launch.yaml here) the prefill's launch booked on the decode step
# before it: the shipped file, the file before it and the static policies.
#   bash docs/results/gpu22/replay_12_8.sh > docs/results/gpu22/replay_12_8.txt
set -e
cd "$(dirname "$0")/../../.."
export PYTHONPATH=$PWD
for server in docs/results/h200/fidelity/dense_spec.yaml docs/results/gpu22/dense_spec_launch.yaml; do
  for rate in 12 8; do
    for f in controller/data/default_policy.npz docs/results/off_probe/policy_3dd256a8.npz; do
      echo "## server $server, $rate requests/s, ppo = $f"
      HEADLINE_RATE=$rate python scripts/h200/replay_policies.py --server $server \
        --prior h200_llama31_8b_recorded --acceptance 3.0 --policies ppo --seeds 2 \
        --reentry-warmup --policy-file $f
    done
    echo "## server $server, $rate requests/s, static policies"
    HEADLINE_RATE=$rate python scripts/h200/replay_policies.py --server $server \
      --prior h200_llama31_8b_recorded --acceptance 3.0 --policies static_0,static_3 \
      --seeds 1 --reentry-warmup
  done
done
