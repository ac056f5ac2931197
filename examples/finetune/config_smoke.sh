#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# CTest run of finetune's mlx-lm interface on SmolLM2-135M: mlx-lm's example lora_config.yaml
# (every key it has, with values for a 4-step run) given by -c, one key overridden on the command
# line; then checks that every key took effect -- in the adapter_config.json the run records (as
# mlx-lm's does), in the report lines, the schedule's learning rates, the trained tensors and the
# optimizer's hyperparameters in the checkpoint. Then --test alone on the saved adapters (the same
# test loss), a full finetune of the last layer, a DoRA run over the quantized base read back by
# --test, and the errors for a mistyped flag, a mistyped
# config key, a bad number and --device cuda in the CPU-only build. Exit 77 (skipped) without the model wheel or bible-kjv.
set -euo pipefail
exe=$1
work=$2
src=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$src/smoke_model.sh" "${3:-}"
head -n 8 "$work/data/valid.jsonl" > "$work/data/test.jsonl"
fail() { echo "finetune config smoke: $*" >&2; exit 1; }

# mlx-lm's examples/lora_config.yaml, key for key, adapted to this model and a short run
cat > "$work/mlx.yaml" <<EOF
model: "$model"
train: true
fine_tune_type: lora
training_mode: normal
optimizer: adamw
optimizer_config:
  adamw:
    betas: [0.9, 0.98]
    eps: 1e-6
    weight_decay: 0.05
    bias_correction: true
data: "$work/data"
seed: 3
num_layers: 4
batch_size: 2
iters: 6
val_batches: 2
learning_rate: 1e-4
steps_per_report: 2
steps_per_eval: 2
resume_adapter_file: null
adapter_path: "$work/cfg"
save_every: 2
test: true
test_batches: 3
max_seq_length: 33
grad_checkpoint: true
lora_parameters:
  keys: ["self_attn.q_proj", "self_attn.v_proj"]
  rank: 4
  scale: 10.0
  dropout: 0.0
lr_schedule:
  name: cosine_decay
  warmup: 1
  warmup_init: 1e-7
  arguments: [1e-4, 3, 1e-7]
mask_prompt: true
grad_accumulation_steps: 1
EOF
# iters: the command line (4) overrides the file (6), as in mlx-lm
# --chat-template chatml: the prompts fit max_seq_length 33 without SmolLM2's template's system prompt
"$exe" -c "$work/mlx.yaml" --chat-template chatml --iters 4 --threads 2 | tee "$work/cfg.log"

grep -q "^LoRA rank 4 scale 10 on 8 projections" "$work/cfg.log" || fail "rank/scale/keys/num_layers not applied"
grep -q "^gradient checkpointing" "$work/cfg.log" || fail "grad_checkpoint not applied"
grep -q "loss on the completions only" "$work/cfg.log" || fail "mask_prompt not applied"
grep -q "^run: lora on 4 layers, rank 4; optimizer adamw, .*(lr_schedule cosine_decay); batch 2, 4 iters, max seq 33" \
  "$work/cfg.log" || fail "the run header does not show the config"
[[ $(grep -c "^Iter [0-9]*: Train loss" "$work/cfg.log") == 2 ]] || fail "steps_per_report 2 over 4 iters: expected 2 reports"
[[ $(grep -c "^Iter [0-9]*: Val loss" "$work/cfg.log") == 3 ]] || fail "steps_per_eval 2: expected validations at 0, 2, 4"
grep -q "^Iter 4: Train loss [0-9.]*, Learning Rate [0-9.e+-]*, It/sec [0-9.]*, Tokens/sec [0-9.]*, Trained Tokens [0-9]*, Peak mem [0-9.]* GB$" \
  "$work/cfg.log" || fail "no mlx-lm report line"
grep -q "^Test loss [0-9.]*, Test ppl [0-9.]*\.$" "$work/cfg.log" || fail "test: true gave no test loss"

python3 - "$work" "$model" <<'EOF'
import json, math, struct, sys
work, model = sys.argv[1], sys.argv[2]
cfg = json.load(open(f"{work}/cfg/adapter_config.json"))
want = {"model": model, "train": True, "fine_tune_type": "lora", "optimizer": "adamw", "data": f"{work}/data",
        "seed": 3, "num_layers": 4, "batch_size": 2, "iters": 4, "val_batches": 2, "learning_rate": 1e-4,
        "steps_per_report": 2, "steps_per_eval": 2, "resume_adapter_file": None, "adapter_path": f"{work}/cfg",
        "save_every": 2, "test": True, "test_batches": 3, "max_seq_length": 33, "grad_checkpoint": True,
        "mask_prompt": True, "grad_accumulation_steps": 1, "config": f"{work}/mlx.yaml",
        "lora_parameters": {"keys": ["self_attn.q_proj", "self_attn.v_proj"], "rank": 4, "scale": 10.0, "dropout": 0.0},
        "lr_schedule": {"name": "cosine_decay", "warmup": 1, "warmup_init": 1e-7, "arguments": [1e-4, 3, 1e-7]},
        "optimizer_config": {"adamw": {"betas": [0.9, 0.98], "eps": 1e-6, "weight_decay": 0.05, "bias_correction": True}}}
bad = [f"{k}: {cfg.get(k)!r} != {v!r}" for k, v in want.items() if cfg.get(k) != v]
assert not bad, "adapter_config.json: " + "; ".join(bad)

# lr_schedule: a linear warm-up from 1e-7 over 1 step, then cosine_decay(1e-4, 3, 1e-7) (MLX's formulas)
def lr(step):  # the rate of the update at optimizer step `step` (0-based): join at warmup + 1 = 2
    if step < 2:
        return 1e-7 + (1e-4 - 1e-7) * min(step, 1) / 1
    return 1e-7 + (1e-4 - 1e-7) * 0.5 * (1 + math.cos(math.pi * min(step - 2, 3) / 3))
got = [r["lr"] for r in map(json.loads, open(f"{work}/cfg/metrics.jsonl")) if "lr" in r]
assert len(got) == 4, got
for i, g in enumerate(got):  # step i + 1 logs the rate its update used (float32)
    assert abs(g - lr(i)) <= 1e-6 * abs(lr(i)), f"learning rate of step {i + 1}: {g} != {lr(i)}"

def header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))
h = header(f"{work}/cfg/adapters.safetensors")
names = sorted(k for k in h if k != "__metadata__")
layers = sorted({int(k.split(".")[2]) for k in names})
assert layers == [26, 27, 28, 29], layers  # num_layers: 4 (of 30)
assert all(k.split(".")[4] in ("q_proj", "v_proj") for k in names), names
assert all(4 in h[k]["shape"] for k in names), "rank 4"
meta = header(f"{work}/cfg/checkpoint.safetensors")["__metadata__"]  # optimizer + optimizer_config
hyper = {k: meta.get(f"optimizer.{k}") for k in ("type", "b1", "b2", "eps", "wd", "bias_correction")}
assert hyper["type"] == "AdamW" and float(hyper["b2"]) == 0.98 and float(hyper["eps"]) == 1e-6, hyper
assert float(hyper["wd"]) == 0.05 and float(hyper["b1"]) == 0.9 and hyper["bias_correction"] == "true", hyper
assert meta["optimizer.schedule"].startswith("join_schedules([linear_schedule(init=9.99"), meta["optimizer.schedule"]
print("finetune config smoke: every config key took effect")
EOF

# --test alone: the adapters in --adapter-path, the same test loss as after training
"$exe" -c "$work/mlx.yaml" --chat-template chatml --train=false --test --iters 4 | tee "$work/test.log"
[[ "$(grep '^Test loss' "$work/cfg.log")" == "$(grep '^Test loss' "$work/test.log")" ]] ||
  fail "--test on the saved adapters differs from the test loss after training"

# --fine-tune-type full: the last layer's own weights trained and saved for mlx-lm
"$exe" --model "$model" --data "$work/data" --chat-template chatml --train --fine-tune-type full --num-layers 1 --iters 1 --batch-size 2 \
  --seq 32 --val-batches 1 --adapter-path "$work/full" | tee "$work/full.log"
grep -q "^full finetune of the last 1 layers" "$work/full.log" || fail "no full finetune"
python3 - "$work/full" <<'EOF'
import json, struct, sys
with open(f"{sys.argv[1]}/adapters.safetensors", "rb") as f:
    h = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
names = [k for k in h if k != "__metadata__"]
assert names and all(k.startswith("model.layers.29.") for k in names), names
assert json.load(open(f"{sys.argv[1]}/adapter_config.json"))["fine_tune_type"] == "full"
EOF

# ... and --resume continues it bit for bit: 1 step + 1 resumed step = 2 steps straight
full=(--model "$model" --data "$work/data" --chat-template chatml --fine-tune-type full --num-layers 1 --batch-size 2 --seq 32
      --steps-per-eval 0 --val-batches 1 --learning-rate 1e-4)
"$exe" "${full[@]}" --iters 1 --adapter-path "$work/full1" > /dev/null
"$exe" "${full[@]}" --iters 2 --adapter-path "$work/full1" --resume > "$work/full-resume.log"
grep -q "^resumed at step 1" "$work/full-resume.log" || fail "full: no resume"
"$exe" "${full[@]}" --iters 2 --adapter-path "$work/full2" > /dev/null
cmp "$work/full1/adapters.safetensors" "$work/full2/adapters.safetensors" ||
  fail "full finetune: the resumed run differs from the straight one"

# --fine-tune-type dora over the quantized base: mlx-lm's adapter folder with the magnitudes, and
# --test alone reads it back to the test loss the run ended with
dora=(--model "$model" --data "$work/data" --chat-template chatml --fine-tune-type dora --num-layers 1 --batch-size 2 --seq 32
      --val-batches 1 --test --test-batches 2 --adapter-path "$work/dora")
"$exe" "${dora[@]}" --train --iters 2 --steps-per-eval 0 | tee "$work/dora.log"
grep -q "^DoRA rank 8 scale 20 on 7 projections" "$work/dora.log" || fail "no DoRA"
python3 - "$work/dora" <<'EOF2'
import json, struct, sys
with open(f"{sys.argv[1]}/adapters.safetensors", "rb") as f:
    h = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
m = [k for k in h if k.endswith(".m")]
assert len(m) == 7 and all(k.startswith("model.layers.29.") for k in m), m
assert json.load(open(f"{sys.argv[1]}/adapter_config.json"))["fine_tune_type"] == "dora"
EOF2
"$exe" "${dora[@]}" --train=false > "$work/dora-test.log"
[[ "$(grep '^Test loss' "$work/dora.log")" == "$(grep '^Test loss' "$work/dora-test.log")" ]] ||
  fail "DoRA: --test on the saved adapters differs from the test loss after training"

# errors that name what is wrong
expect_error() {  # expect_error PATTERN ARGS...
  local pat=$1; shift
  if "$exe" "$@" > "$work/err.log" 2>&1; then fail "accepted: $*"; fi
  grep -q -- "$pat" "$work/err.log" || { cat "$work/err.log" >&2; fail "the error for '$*' does not say '$pat'"; }
}
expect_error "did you mean --learning-rate" --model "$model" --data "$work/data" --learning-rat 1e-4
expect_error "iters" --model "$model" --data "$work/data" --iters abc
sed 's/^batch_size:/batch_sise:/' "$work/mlx.yaml" > "$work/typo.yaml"
expect_error "unknown option 'batch_sise'; did you mean batch_size" -c "$work/typo.yaml"
expect_error "num-layers 40: the model has only 30 layers" --model "$model" --data "$work/data" --num-layers 40
expect_error "cannot express DoRA" --model "$model" --data "$work/data" --fine-tune-type dora --export-adapter "$work/a.gguf"
expect_error "built without CUDA (build the finetune_cuda" --model "$model" --data "$work/data" --iters 1 --device cuda
expect_error "device: gpu not in {cpu,cuda}\|gpu not in" --model "$model" --data "$work/data" --device gpu
"$exe" --help > "$work/help.txt"
grep -q -- "--fine-tune-type" "$work/help.txt" || fail "--help does not list --fine-tune-type"
echo "finetune config smoke: ok"
