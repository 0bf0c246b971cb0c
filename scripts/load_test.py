#!/usr/bin/python3
"""Bounded load test of `r3 serve` on loopback.

64 concurrent clients send a few thousand /generate and /v1/completions requests (mixed prompt
and output lengths, shared prefixes, some streamed, some disconnecting mid-stream). Checks: zero
server errors, every complete reply's routes decode to [S-1, L_moe, K] and equal the solo run of
the same request (the Python module r3, prefix cache off, one request at a time), disconnected
requests aborted with every KV block back in the pool, and the server's memory after the run
against its baseline.

usage: scripts/load_test.py [BUILD_DIR] [--clients 64] [--requests 2000]
"""
import argparse
import base64
import http.client
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ap = argparse.ArgumentParser()
ap.add_argument("build", nargs="?", default="build")
ap.add_argument("--clients", type=int, default=64)
ap.add_argument("--requests", type=int, default=2000)
ap.add_argument("--disconnect", type=float, default=0.05)
ap.add_argument("--rounds", type=int, default=3, help="repeat the traffic to see memory settle")
args = ap.parse_args()
build = os.path.abspath(args.build)
sys.path.insert(0, os.path.join(build, "python"))
import r3  # noqa: E402

work = tempfile.mkdtemp(prefix="r3_load_")
model = os.path.join(work, "model")
subprocess.run([f"{build}/r3", "make-model", "--arch", "olmoe", "--preset", "tiny", "--out", model], check=True)
server = subprocess.Popen([f"{build}/r3", "serve", "--model", model, "--port", "0", "--threads", "2",
                           "--num-kv-blocks", "512", "--max-num-seqs", "32",
                           "--enable-return-routed-experts"], stderr=subprocess.PIPE, text=True)
port = None
for line in server.stderr:
    m = re.search(r"http://127\.0\.0\.1:(\d+)", line)
    if m:
        port = int(m.group(1))
        break
threading.Thread(target=lambda: [None for _ in server.stderr], daemon=True).start()


def rss_kb():
    with open(f"/proc/{server.pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))


def post(path, body):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, json.loads(data)


def decode(env):
    a = np.frombuffer(base64.b64decode(env["data"]), dtype=np.dtype(env["dtype"]).newbyteorder("<"))
    return a.reshape(env["shape"])


rng = random.Random(7)
bases = [[rng.randrange(3, 500) for _ in range(48)] for _ in range(4)]
jobs = []
for i in range(args.requests):
    p = bases[i % 4][: rng.randrange(1, 48)] + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 24))]
    jobs.append(dict(i=i, prompt=p, max_tokens=rng.randrange(1, 24), seed=rng.randrange(1 << 30),
                     kind=rng.choice(["generate", "completions", "stream"]),
                     disconnect=rng.random() < args.disconnect))

results, errors = {}, []
lock = threading.Lock()


def run_one(job):
    sp = {"temperature": 1.0, "seed": job["seed"], "ignore_eos": True}
    if job["kind"] == "generate":
        st, r = post("/generate", {"input_ids": job["prompt"], "sampling_params": dict(sp, max_new_tokens=job["max_tokens"]),
                                   "return_routed_experts": True})
        if st != 200:
            raise RuntimeError(f"{st} {r}")
        return r["output_ids"], decode(r["meta_info"]["routed_experts"])
    body = dict(sp, prompt=job["prompt"], max_tokens=job["max_tokens"], return_routed_experts=True,
                stream=job["kind"] == "stream")
    if not body["stream"]:
        st, r = post("/v1/completions", body)
        if st != 200:
            raise RuntimeError(f"{st} {r}")
        return r["choices"][0]["token_ids"], decode(r["choices"][0]["routed_experts"])
    s = socket.create_connection(("127.0.0.1", port), timeout=120)
    payload = json.dumps(dict(body, max_tokens=job["max_tokens"] + (40 if job["disconnect"] else 0)))
    s.sendall((f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(payload)}\r\n\r\n{payload}").encode())
    if job["disconnect"]:
        s.recv(64)
        s.close()
        return None
    buf = b""
    while b"data: [DONE]" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
    s.close()
    tokens, routes = [], None
    for line in buf.decode().split("\n"):
        if line.startswith("data: {"):
            ev = json.loads(line[6:])
            for ch in ev.get("choices", []):
                tokens += ch.get("token_ids") or []
                if ch.get("routed_experts"):
                    routes = decode(ch["routed_experts"])
    return tokens, routes


def worker(my_jobs):
    for job in my_jobs:
        try:
            out = run_one(job)
            with lock:
                results[job["i"]] = out
        except Exception as e:  # noqa: BLE001
            with lock:
                errors.append((job["i"], repr(e)))


time.sleep(0.2)
post("/generate", {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
rss0 = rss_kb()
rss_rounds = []
t0 = time.time()
for _ in range(args.rounds):
    threads = [threading.Thread(target=worker, args=(jobs[c::args.clients],)) for c in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(1.5)  # let aborts of disconnected streams land
    rss_rounds.append(rss_kb())
elapsed = time.time() - t0 - 1.5 * args.rounds
metrics = http.client.HTTPConnection("127.0.0.1", port)
metrics.request("GET", "/metrics")
text = metrics.getresponse().read().decode()
rss1 = rss_kb()

solo = r3.LLM(model=model, enable_return_routed_experts=True, enable_prefix_caching=False, max_num_seqs=1,
              max_num_batched_tokens=4096, num_kv_blocks=128, threads=1)
mismatches = 0
checked = 0
for job in jobs:
    out = results.get(job["i"])
    if out is None:
        continue
    tokens, routes = out
    want = solo.generate([{"prompt_token_ids": job["prompt"]}],
                         r3.SamplingParams(max_tokens=job["max_tokens"], temperature=1.0, seed=job["seed"],
                                           ignore_eos=True, return_routed_experts=True))[0].outputs[0]
    S = len(job["prompt"]) + len(tokens)
    ok = list(want.token_ids) == list(tokens) and routes is not None and routes.shape == (S - 1, 2, 2) \
        and np.array_equal(routes, want.routed_experts)
    mismatches += not ok
    checked += 1
server.terminate()
server.wait()
free = re.search(r"r3_kv_blocks_free\S* (\d+)", text)
total = re.search(r"r3_kv_blocks_total\S* (\d+)", text)
print(json.dumps({"requests": len(jobs) * args.rounds, "clients": args.clients, "seconds": round(elapsed, 2),
                  "requests_per_s": round(len(jobs) * args.rounds / elapsed, 1), "errors": len(errors),
                  "checked_against_solo": checked, "mismatches": mismatches,
                  "disconnected": args.rounds * sum(j["disconnect"] and j["kind"] == "stream" for j in jobs),
                  "kv_blocks_free_after": free and int(free.group(1)), "kv_blocks_total": total and int(total.group(1)),
                  "rss_kb_before": rss0, "rss_kb_after_each_round": rss_rounds}, indent=1))
if errors:
    print("first errors:", errors[:5])
sys.exit(1 if errors or mismatches else 0)
