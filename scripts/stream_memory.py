#!/usr/bin/python3
"""What route-returning streams cost the server in memory: N concurrent streamed
/v1/completions against `r3 serve`, the server's resident memory (VmRSS) sampled every 10 ms. A
warm-up round first touches the whole KV pool (sized to the streams: the pool is committed as it
is written, which would otherwise hide everything else), then rounds alternate routes on and off;
prints each round's peak above the idle server, and the bytes of route rows the requests own
(their stores: one row per position, L_moe x K int16, plus float32 gate weights with --weights).

usage: scripts/stream_memory.py MODEL_DIR [--build build] [--streams 64] [--prompt 32] [--tokens 128]
"""
import argparse
import http.client
import json
import os
import socket
import subprocess
import threading
import time

ap = argparse.ArgumentParser()
ap.add_argument("model")
ap.add_argument("--build", default="build")
ap.add_argument("--streams", type=int, default=64)
ap.add_argument("--prompt", type=int, default=32)
ap.add_argument("--tokens", type=int, default=128)
ap.add_argument("--weights", action="store_true", help="also ask for the gate weights")
args = ap.parse_args()


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


port = free_port()
blocks = args.streams * -(-(args.prompt + args.tokens) // 16)
server = subprocess.Popen([os.path.join(args.build, "r3"), "serve", "--model", args.model, "--port", str(port),
                           "--enable-return-routed-experts", "--max-num-seqs", str(args.streams),
                           "--num-kv-blocks", str(blocks), "--no-enable-prefix-caching"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    for _ in range(600):
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                break
        except OSError:
            time.sleep(0.1)
    cfg = json.load(open(os.path.join(args.model, "config.json")))
    cfg = cfg.get("text_config", cfg)

    def stream(i, routes):
        body = {"prompt": [3 + (i * 31 + j * 7) % 500 for j in range(args.prompt)], "max_tokens": args.tokens,
                "temperature": 1.0, "seed": i, "ignore_eos": True, "stream": True,
                "return_routed_experts": routes, "return_routed_expert_weights": routes and args.weights,
                "routed_experts_format": "r3"}
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        c.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        for _line in c.getresponse():  # read every chunk as it comes
            pass

    def round_(routes):
        idle = rss_mb(server.pid)
        peak = [idle]
        done = threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], rss_mb(server.pid))
                time.sleep(0.01)

        sampler = threading.Thread(target=sample)
        sampler.start()
        t0 = time.time()
        clients = [threading.Thread(target=stream, args=(i, routes)) for i in range(args.streams)]
        for t in clients:
            t.start()
        for t in clients:
            t.join()
        seconds = time.time() - t0
        done.set()
        sampler.join()
        return idle, peak[0], seconds

    moe_layers = cfg["num_hidden_layers"]  # an upper bound: every layer MoE
    k = cfg["num_experts_per_tok"]
    positions = args.prompt + args.tokens
    per_row = moe_layers * k * (2 + (4 if args.weights else 0))
    owned = args.streams * positions * per_row / 2**20
    cache = blocks * 16 * (moe_layers * k * 6 + 8) / 2**20  # ids, weights and stamps per KV slot
    print(f"{args.streams} streams x ({args.prompt} prompt + {args.tokens} tokens); route rows owned by the "
          f"requests at most {owned:.2f} MB ({positions} rows x {per_row} B each); the engine's shared route "
          f"cache (fixed by the KV pool of {blocks} blocks, first touched as written) {cache:.2f} MB")
    round_(False)  # warm-up: touches the KV pool
    for routes in (True, False, True, False):
        idle, peak, seconds = round_(routes)
        print(f"routes {'on ' if routes else 'off'}: server RSS idle {idle:.1f} MB, peak {peak:.1f} MB "
              f"(+{peak - idle:.1f} MB), {args.streams * args.tokens / seconds:.0f} tok/s")
finally:
    server.terminate()
    server.wait(timeout=30)
