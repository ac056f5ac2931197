#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# Gradient averaging's cost per step at 2 ranks (one thread each), over shared memory and over TCP
# on loopback: bench_allreduce under OpenMPI's mpirun, one table each.
#   bash bench/run_allreduce.sh [BUILD_DIR] [--np 2] [--rounds 30]
set -euo pipefail
build=${1:-build}
shift || true
np=2 rounds=30
while (($#)); do
  case $1 in
    --np) np=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    *) echo "run_allreduce.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
for btl in self,vader self,tcp; do
  OMP_NUM_THREADS=1 mpirun --allow-run-as-root --oversubscribe --mca btl "$btl" -np "$np" \
    "$build/bench/bench_allreduce" --rounds "$rounds"
  echo
done
