#!/bin/bash
# Throughput (tok/s) of each policy file on the windows below (trace_depths.py: specctl-eval's
# windows, seeds and simulator), one row per file. From the repository root, venv active:
#   bash docs/results/nopro26/screen.sh controller/data/default_policy.npz docs/results/nopro26/policy_*.npz
WINDOWS=(
  "3|azure_conv load=0.5 mod=0 blackwell_tp8 prior=none"
  "3|azure_conv load=0.5 mod=0.8 blackwell_tp8 prior=none"
  "3|azure_conv load=1.5 mod=0 blackwell_tp8 prior=none"
  "2|azure_conv load=0.5 mod=0 blackwell_tp8 prior=none"
  "2|azure_conv load=1.5 mod=0 h100_llama31_8b prior=none"
  "2|azure_conv load=1.5 mod=0.8 h100_llama31_8b prior=none"
  "2|fixed C=64 blackwell_tp8 prior=none"
  "0|azure_code load=1.5 mod=0 moe_h200_acc1.1 prior=none"
  "0|azure_code load=1.5 mod=0 moe_h200_acc2.5 prior=none"
  "0|azure_code load=1.5 mod=0.8 random-0 prior=none"
)
source docs/results/nopro24/screen_windows.sh "$@"
