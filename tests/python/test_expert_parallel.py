"""Expert parallelism over MPI (docs/EXPERT_PARALLEL.md): `mpirun -np 2 r3 ... --expert-parallel 2`
gives the tokens, logprobs and routes of one process bit for bit under random schedules, and a
rank that dies fails the engine closed (errors, /health 503) within the timeout instead of
hanging it."""
import base64
import http.client
import io
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

MPIRUN = shutil.which("mpirun")
# Root in CI containers; every rank on any core (two ranks of one thread each on two cores).
MPI_ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
MPI_FLAGS = ["--oversubscribe", "--bind-to", "none"]
# A dead rank leaves rank 0 serving (its engine fails closed) instead of mpirun killing the job;
# mpirun then exits 0 whatever the ranks returned, so only the server test uses it.
SURVIVE = ["--mca", "orte_abort_on_non_zero_status", "0"]


def mpirun(n, args, survive=False):
    assert MPIRUN, "mpirun not found: scripts/setup.sh installs openmpi-bin"
    return [MPIRUN, *MPI_FLAGS, *(SURVIVE if survive else []), "-np", str(n), *args]


def write_requests(path, rng, vocab):
    """Prompts sharing prefixes (prefix cache hits), of random lengths (chunked prefill), with
    random sampling, every one asking for its routes."""
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randrange(16, 48))] for _ in range(2)]
    with open(path, "w") as f:
        for i in range(rng.randrange(10, 16)):
            shared = rng.choice(prefixes + [[]])
            prompt = shared + [rng.randrange(vocab) for _ in range(rng.randrange(1, 70))]
            f.write(json.dumps({"prompt_token_ids": prompt, "max_tokens": rng.randrange(1, 24),
                                "temperature": rng.choice([0.0, 0.7, 1.0]), "top_p": rng.choice([1.0, 0.9]),
                                "seed": rng.randrange(1 << 30), "ignore_eos": True, "top_logprobs": rng.choice([0, 2]),
                                "return_routed_experts": True}) + "\n")


ARCHS = ["olmoe", "deepseek_v3", "gpt_oss", "qwen3_next"]  # GQA, MLA with shared experts, sliding windows + biases,
# Gated DeltaNet (recurrent state per request, prefix hits restoring its snapshots)


@pytest.mark.parametrize("arch", ARCHS)
def test_two_ranks_equal_one_process_bit_for_bit(make_model, r3_bin, tmp_path, arch):
    model = make_model(arch)
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    preempted = cached = 0
    for seed in range(3):
        rng = random.Random(f"{arch}-{seed}")
        requests = tmp_path / f"in{seed}.jsonl"
        write_requests(requests, rng, vocab)
        engine = ["--model", model, "--input", str(requests), "--no-progress",
                  "--max-num-batched-tokens", str(rng.choice([16, 32, 64])),
                  "--num-kv-blocks", str(rng.choice([20, 28, 64])),  # small pools preempt
                  "--eplb-redundant-experts", str([0, 2, 3][seed]),  # replicas on both ranks
                  ("--overlap-scheduler" if seed != 1 else "--no-overlap-scheduler")]
        solo = tmp_path / f"solo{seed}.jsonl"
        spread = tmp_path / f"ep{seed}.jsonl"
        subprocess.run([r3_bin, "generate", *engine, "--output", str(solo)], check=True, capture_output=True)
        run = subprocess.run(mpirun(2, [r3_bin, "generate", *engine, "--output", str(spread), "--expert-parallel", "2",
                                        "--threads", "1"]), env=MPI_ENV, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        assert "r3 rank 1 of 2" in run.stderr
        a, b = solo.read_text().splitlines(), spread.read_text().splitlines()
        assert len(a) == len(b) and len(a) > 0
        for x, y in zip(a, b):
            assert json.loads(x) == json.loads(y)  # tokens, logprobs, top logprobs, routes, cache hits
        outs = [json.loads(x) for x in a]
        assert all(o["routed_experts"] for o in outs if o["token_ids"])
        preempted += sum(o["num_preemptions"] for o in outs)
        cached += sum(o["num_cached_tokens"] for o in outs)
    assert preempted > 0 and cached > 0, (preempted, cached)  # the schedules did exercise both


def test_speculative_decoding_on_two_ranks_equals_one_process_without_it(make_model, r3_bin, tmp_path):
    """NGRAM drafts are plan tokens the ranks compute like any other: two ranks with speculation
    give one process's tokens, logprobs, top logprobs and routes without it, bit for bit."""
    model = make_model("olmoe")
    vocab = json.load(open(os.path.join(model, "config.json")))["vocab_size"]
    rng = random.Random("speculative")
    requests = tmp_path / "in.jsonl"
    with open(requests, "w") as f:
        for i in range(8):
            stretch = [rng.randrange(vocab) for _ in range(rng.randrange(4, 20))]
            f.write(json.dumps({"prompt_token_ids": stretch * rng.choice([1, 2, 3]), "max_tokens": rng.randrange(4, 30),
                                "temperature": rng.choice([0.0, 0.0, 1.0]), "seed": rng.randrange(1 << 30),
                                "ignore_eos": True, "top_logprobs": rng.choice([0, 2]),
                                "return_routed_experts": True}) + "\n")
    engine = ["--model", model, "--input", str(requests), "--no-progress", "--max-num-batched-tokens", "32",
              "--num-kv-blocks", "40", "--max-num-seqs", "4"]
    solo, spread = tmp_path / "solo.jsonl", tmp_path / "ep.jsonl"
    subprocess.run([r3_bin, "generate", *engine, "--output", str(solo)], check=True, capture_output=True)
    run = subprocess.run(mpirun(2, [r3_bin, "generate", *engine, "--output", str(spread), "--expert-parallel", "2",
                                    "--threads", "1", "--speculative-algorithm", "NGRAM",
                                    "--speculative-num-draft-tokens", "3"]),
                         env=MPI_ENV, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    keys = ["token_ids", "logprobs", "top_logprobs", "routed_experts", "finish_reason", "weight_versions"]
    a, b = solo.read_text().splitlines(), spread.read_text().splitlines()
    assert len(a) == len(b) == 8
    for x, y in zip(a, b):
        x, y = json.loads(x), json.loads(y)
        assert {k: x.get(k) for k in keys} == {k: y.get(k) for k in keys}


def test_expert_parallel_refuses_what_it_cannot_do(make_model, r3_bin, tmp_path):
    model = make_model("olmoe")
    requests = tmp_path / "in.jsonl"
    requests.write_text(json.dumps({"prompt_token_ids": [1, 2, 3], "max_tokens": 2}) + "\n")
    base = [r3_bin, "generate", "--model", model, "--input", str(requests), "--no-progress"]
    # Without mpirun: a clear error, not a hang.
    run = subprocess.run(base + ["--expert-parallel", "2"], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "mpirun -np 2" in run.stderr
    # Ranks and flag disagree.
    run = subprocess.run(mpirun(2, base + ["--expert-parallel", "3"]), env=MPI_ENV, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0 and "--expert-parallel 3 but mpirun started 2 ranks" in run.stderr
    # mpirun without the flag would run the whole command twice.
    run = subprocess.run(mpirun(2, base), env=MPI_ENV, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "pass --expert-parallel 2" in run.stderr


def test_the_python_module_refuses_expert_parallel_and_says_why(make_model):
    import r3
    with pytest.raises(Exception, match="mpirun -np 2 r3"):
        r3.LLM(make_model("olmoe"), expert_parallel=2)


def test_a_rank_that_cannot_build_its_engine_fails_rank_0_with_a_clear_error(make_model, r3_bin, tmp_path):
    model = make_model("olmoe")
    requests = tmp_path / "in.jsonl"
    requests.write_text(json.dumps({"prompt_token_ids": [1, 2, 3], "max_tokens": 2}) + "\n")
    args = ["generate", "--model", model, "--input", str(requests), "--no-progress", "--expert-parallel", "2",
            "--overlap-scheduler"]
    # Rank 1 alone gets an instruction set that does not exist, so only its engine fails to build.
    run = subprocess.run([MPIRUN, *MPI_FLAGS, "-np", "1", r3_bin, *args, ":", "-np", "1", "env", "R3_KERNELS=bogus",
                          r3_bin, *args], env=MPI_ENV, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0, run.stderr
    assert "rank 1 could not build its engine" in run.stderr, run.stderr
    assert "another rank could not build its engine" in run.stderr, run.stderr
    assert "terminate called" not in run.stderr and "Aborted" not in run.stderr, run.stderr


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, timeout=10):
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def post(url, body, timeout=60):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["dies", "stops_answering"])
def test_a_lost_rank_fails_the_server_closed_within_the_timeout(make_model, r3_bin, tmp_path, fault):
    model = make_model("olmoe")
    port = free_port()
    log = open(tmp_path / "serve.log", "w+")
    job = subprocess.Popen(mpirun(2, [r3_bin, "serve", "--model", model, "--port", str(port), "--expert-parallel", "2",
                                      "--threads", "1", "--expert-timeout-s", "5", "--enable-return-routed-experts"],
                                  survive=True),
                           env=MPI_ENV, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if get(url + "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        else:
            pytest.fail("the server did not come up: " + open(tmp_path / "serve.log").read())
        status, body = post(url + "/generate", {"input_ids": [1, 2, 3, 4], "sampling_params": {"max_new_tokens": 4},
                                                "return_routed_experts": True})
        assert status == 200 and json.loads(body)["meta_info"]["routed_experts"], body
        log.flush()
        pid = int(re.search(r"r3 rank 1 of 2 \(pid (\d+)\)", open(tmp_path / "serve.log").read()).group(1))
        # A request streaming, then the rank goes mid-request.
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({
            "prompt": [5, 6, 7], "max_tokens": 3000, "ignore_eos": True, "return_routed_experts": True,
            "stream": True}), {"Content-Type": "application/json"})
        stream = conn.getresponse()
        assert stream.status == 200, stream.read()
        first = stream.readline()
        assert first.startswith(b"data:"), first
        os.kill(pid, fault)
        lost = time.time()
        rest = stream.read().decode()  # ends within the timeout: never a hang
        took = time.time() - lost
        conn.close()
        events = [json.loads(l[5:]) for l in rest.splitlines() if l.startswith("data:") and l[5:].strip() != "[DONE]"]
        assert events and "error" in events[-1], rest[-2000:]  # it ends in an error ...
        assert "rank 1 did not answer within 5 s" in json.dumps(events[-1]), events[-1]
        # ... and no choice finished: what streamed before (tokens, each chunk with its tokens' route
        # rows and never more) belongs to a failed request, as the error chunk says.
        chunks = [c for e in events for c in e.get("choices", [])]
        assert not any(c.get("finish_reason") for c in chunks)
        rows = sum(np.load(io.BytesIO(base64.b64decode(c["routed_experts"]))).shape[0]
                   for c in chunks if c.get("routed_experts"))
        assert rows <= sum(len(c["token_ids"]) for c in chunks) + 1
        assert took < 5 + 10, took
        status, body = get(url + "/health")
        assert status == 503 and "rank 1 did not answer" in body, body  # still serving, saying why
        status, body = post(url + "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}})
        assert status == 503, body
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        log.close()
