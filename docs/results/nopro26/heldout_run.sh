#!/bin/bash
# usage: run.sh <tree> <policy> <name>
. /work/main/.venv/bin/activate
cd $1
for s in 8 9 10 11 12 13 14 15; do
  PYTHONPATH=$PWD nice -n 5 specctl-eval seed=$s eval.workers=1 policy=$2 hydra.run.dir=/tmp/h26/$3_s$s > /tmp/h26/$3_s$s.log 2>&1
done
