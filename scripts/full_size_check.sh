#!/bin/bash
# A real-size checkpoint on this machine (issue 42): start-up from a cold and a warm page cache,
# peak resident memory, and r3 serve's /generate with routes (3 requests at once) against solo
# `r3 generate` runs of the same prompts, bit for bit (tokens, logprobs, routes); then a refit
# from disk of the same files: its time, its peak memory above the resident weights, the same bits after.
#   scripts/full_size_check.sh MODEL_DIR [BUILD_DIR]
# Make the model first, e.g. `build/r3 make-model --arch olmoe --preset full --out /tmp/full`
# (13.8 GB) or `--arch gpt_oss --quant mxfp4 --preset full` (13.8 GB); delete it afterwards.
# The cold figures need root (/proc/sys/vm/drop_caches); without it they are skipped.
set -euo pipefail
M=${1:?usage: scripts/full_size_check.sh MODEL_DIR [BUILD_DIR]}
B=${2:-build}
R3=$(realpath "$B/r3")
PY=/usr/bin/python3
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
cd "$W"
$PY - <<'P'
import json
with open("one.jsonl", "w") as f:
    f.write(json.dumps({"prompt_token_ids": [11, 12, 13], "max_tokens": 1, "temperature": 0}) + "\n")
with open("three.jsonl", "w") as f:
    for i in range(3):
        f.write(json.dumps({"prompt_token_ids": [100 + i * 7 + j for j in range(5 + 3 * i)], "max_tokens": 8,
                            "temperature": 1.0, "seed": 5 + i, "return_routed_experts": True,
                            "ignore_eos": True}) + "\n")
P
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
if [ -w /proc/sys/vm/drop_caches ]; then
  drop
  s=$(date +%s.%N); cat "$M"/*.safetensors > /dev/null; e=$(date +%s.%N)
  echo "cold read of the files (cat): $(echo "$e - $s" | bc) s"
  drop
  /usr/bin/time -o cold.time -f "%e %S %M" \
    "$R3" generate --model "$M" --kv-cache-mb 1024 --input one.jsonl --output one.out --no-progress
  read -r wall sys peak_kb < cold.time
  echo "cold r3 generate of 1 token: $wall s wall ($sys s system), peak RSS $peak_kb KB"
  # What no loader can avoid beside the read: the first touch of as many fresh anonymous bytes as
  # r3 kept resident (the kernel clears each page; in a VM the host backs it too), on both cores
  # as r3's packing does: one process per core touching its half, a byte a page.
  s=$(date +%s.%N)
  for _ in 1 2; do
    $PY -c "import numpy as np; a = np.empty($peak_kb * 512, np.uint8); a[::4096] = 1" &
  done
  wait
  e=$(date +%s.%N)
  echo "first touch of $((peak_kb / 1024)) MB of fresh memory on 2 cores: $(echo "$e - $s" | bc) s"
else
  echo "not root: cold figures skipped"
fi
# r3 reads files the page cache does not hold past it, so they are not cached after a cold start:
# read them once for the warm figures (and the refit from disk below reads them from the cache).
s=$(date +%s.%N); cat "$M"/*.safetensors > /dev/null; e=$(date +%s.%N)
echo "read of the files into the page cache (cat): $(echo "$e - $s" | bc) s"
/usr/bin/time -f "warm r3 generate, 3 prompts one at a time with routes: %e s wall (%S s system), peak RSS %M KB" \
  "$R3" generate --model "$M" --kv-cache-mb 1024 --max-num-seqs 1 --enable-return-routed-experts \
  --input three.jsonl --output solo.out --no-progress
PORT=$((20000 + RANDOM % 20000))
"$R3" serve --model "$M" --kv-cache-mb 1024 --enable-return-routed-experts --port $PORT > serve.log 2>&1 &
SP=$!
for _ in $(seq 1 300); do curl -sf localhost:$PORT/health > /dev/null && break; sleep 1; done
cat serve.log
PORT=$PORT $PY - <<'P'
import base64, json, os, threading, urllib.request
import numpy as np
port = os.environ["PORT"]
lines = [json.loads(l) for l in open("three.jsonl")]
solo = [json.loads(l) for l in open("solo.out")]
res = [None] * 3
def go(i):
    L = lines[i]
    body = {"input_ids": L["prompt_token_ids"], "return_routed_experts": True, "routed_experts_start_len": 0,
            "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "seed": L["seed"], "ignore_eos": True}}
    req = urllib.request.Request(f"http://localhost:{port}/generate", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    res[i] = json.loads(urllib.request.urlopen(req).read())
threads = [threading.Thread(target=go, args=(i,)) for i in range(3)]
[t.start() for t in threads]
[t.join() for t in threads]
ok = True
for i in range(3):
    g, s = res[i], solo[i]
    got = np.frombuffer(base64.b64decode(g["meta_info"]["routed_experts"]), dtype="<i4")
    want = np.frombuffer(base64.b64decode(s["routed_experts"]["data"]), dtype=np.dtype(s["routed_experts"]["dtype"]).newbyteorder("<")).astype(np.int32)
    same = (g["output_ids"] == s["token_ids"],
            [x[0] for x in g["meta_info"]["output_token_logprobs"]] == s["logprobs"],
            got.shape == want.shape and bool((got == want).all()))
    print(f"prompt {i}: tokens {same[0]}, logprobs {same[1]}, routes ({got.size} ids) {same[2]}")
    ok = ok and all(same)
print("served concurrently == solo runs:", ok)
raise SystemExit(0 if ok else 1)
P
grep VmHWM /proc/$SP/status
# A refit from disk of the same files, in place: the peak during it (VmHWM reset first) against
# the resident weights; then the same requests again must give the same bits.
rss_kb() { awk '/^VmRSS/ {print $2}' /proc/$SP/status; }
echo 5 > /proc/$SP/clear_refs
before=$(rss_kb)
s=$(date +%s.%N)
curl -sf -X POST localhost:$PORT/update_weights_from_disk -H 'Content-Type: application/json' \
  -d "{\"model_path\": \"$(realpath "$M")\"}"
e=$(date +%s.%N)
peak=$(awk '/^VmHWM/ {print $2}' /proc/$SP/status)
echo
echo "refit from disk: $(echo "$e - $s" | bc) s; resident before $((before / 1024)) MB, peak during $((peak / 1024)) MB" \
  "(+$(((peak - before) / 1024)) MB), after $(($(rss_kb) / 1024)) MB"
PORT=$PORT $PY - <<'P'
import json, os, urllib.request
port = os.environ["PORT"]
L = json.loads(open("three.jsonl").readline())
s = json.loads(open("solo.out").readline())
body = {"input_ids": L["prompt_token_ids"], "sampling_params": {"max_new_tokens": 8, "temperature": 1.0,
        "seed": L["seed"], "ignore_eos": True}}
req = urllib.request.Request(f"http://localhost:{port}/generate", json.dumps(body).encode(),
                             {"Content-Type": "application/json"})
g = json.loads(urllib.request.urlopen(req).read())
same = g["output_ids"] == s["token_ids"] and [x[0] for x in g["meta_info"]["output_token_logprobs"]] == s["logprobs"]
print("after the refit, prompt 0 == solo run:", same)
raise SystemExit(0 if same else 1)
P
kill -TERM $SP
wait $SP || true
