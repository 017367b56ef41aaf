#!/bin/bash
# The throughput (tok/s) of each policy file given on nine specctl-eval windows, one row per
# file, by trace_depths.py (same windows, seeds and simulator as specctl-eval; a window's
# throughput, not its oracle fraction). Run from the repository root with the venv active:
#   bash docs/results/nopro24/screen_windows.sh controller/data/default_policy.npz ...
# Another script's windows: set WINDOWS (a bash array) and source this file with the files.
[ ${#WINDOWS[@]} -gt 0 ] || WINDOWS=(
  "2|fixed C=64 h100_llama31_8b prior=none"
  "2|azure_conv load=1.5 mod=0.8 h100_llama31_8b prior=none"
  "4|fixed C=64 h100_llama31_8b prior=none"
  "2|azure_conv load=1.5 mod=0 blackwell_tp8 prior=none"
  "4|azure_conv load=1.5 mod=0 blackwell_tp8 prior=none"
  "2|fixed C=64 blackwell_tp8 prior=none"
  "2|fixed C=1 random-1 prior=none"
  "2|azure_code load=1.5 mod=0 moe_h200_acc2.5 prior=none"
  "4|azure_conv load=1.5 mod=0.8 random-1 prior=none"
)
echo -n "| file |"; for w in "${WINDOWS[@]}"; do echo -n " s${w%%|*} ${w#*|} |"; done; echo
echo -n "|---|"; for w in "${WINDOWS[@]}"; do echo -n "---|"; done; echo
for policy in "$@"; do
  echo -n "| $(basename "$policy" .npz) |"
  for w in "${WINDOWS[@]}"; do
    tok=$(PYTHONPATH=$PWD:$PWD/scripts nice -n 10 python docs/results/nopro24/trace_depths.py "${w%%|*}" \
          "${w#*|}" --policy "$policy" --every 1000000 2>&1 | tail -1 | awk '{print $2}')
    echo -n " $tok |"
  done
  echo
done
