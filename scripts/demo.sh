#!/usr/bin/env bash
# The main job on a small built-in model: writes a seeded OLMoE-style checkpoint (HF layout),
# runs multi-turn rollouts with routes on the engine, stages them, and reports the
# train/inference mismatch without and with Router Replay.
set -euo pipefail
BUILD=${1:-build}
OUT=${R3_DEMO_DIR:-out/demo}
mkdir -p "$OUT"
[ -f "$OUT/model/config.json" ] || "$BUILD/r3" make-model --arch olmoe --preset small --seed 0 --out "$OUT/model"
if "$BUILD/r3" --help | grep -q "^  align"; then
  "$BUILD/r3" align --model "$OUT/model" --num-prompts 8 --turns 3 --json "$OUT/align.json" --plot "$OUT/align.svg"
  echo "wrote $OUT/align.json and $OUT/align.svg"
else
  printf '%s\n' '{"prompt_token_ids":[1,17,42,99,7],"max_tokens":8,"temperature":0,"return_routed_experts":true}' > "$OUT/prompts.jsonl"
  "$BUILD/r3" generate --model "$OUT/model" --input "$OUT/prompts.jsonl" --output "$OUT/out.jsonl"
  echo "wrote $OUT/out.jsonl"
fi
