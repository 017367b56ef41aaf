#!/bin/bash
# usage: ab.sh tag  -- runs ab_daemon both orders for cold (4 MiB) and warm at 1 and 8 streams
set -e
tag=$1; shift
. /work/main/.venv/bin/activate
out=/work/wt-online25/docs/results/bench_online_pass25
br=/tmp/p25/branch_$tag; rm -rf $br; mkdir -p $br
(cd /work/wt-online25 && git ls-files -co --exclude-standard | grep -v '^docs/' | tar -cf - -T - | tar -xf - -C $br)
[ -n "$PATCH" ] && (cd $br && eval "$PATCH")
base=/tmp/p25/base_$tag; rm -rf $base; cp -r /tmp/p25/base $base
cd /work/wt-online25
for mode in "--cold --cold-mib 4" ""; do
  echo "== $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) mode [$mode] base->branch"
  find $br $base -name "*.nb[ic]" -delete; python $br/benchmarks/ab_daemon.py --before $base --after $br --socket --profile h200_llama31_8b --streams 1 8 $mode "$@"
  echo "== $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) mode [$mode] branch->base (inverted slots)"
  find $br $base -name "*.nb[ic]" -delete; python $br/benchmarks/ab_daemon.py --before $br --after $base --socket --profile h200_llama31_8b --streams 1 8 $mode "$@"
done
