#!/usr/bin/env bash
# The benchmark suite on the bench preset (an OLMoE-like ~2.5 GB bf16 checkpoint, written once).
set -euo pipefail
BUILD=${1:-build}
MODEL=${R3_BENCH_MODEL:-out/bench-model}
[ -f "$MODEL/config.json" ] || "$BUILD/r3" make-model --arch olmoe --preset bench --seed 0 --out "$MODEL"
"$BUILD/r3" bench --model "$MODEL" --json out/bench.json
if [ -x "$BUILD/r3_bench" ]; then "$BUILD/r3_bench" --benchmark_min_time=0.2; fi
