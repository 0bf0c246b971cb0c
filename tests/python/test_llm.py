# The vLLM-like Python API: shapes and dtypes of routes, equality with the solo run and with the
# HTTP server's answer for the same request, refit, errors, and the GIL released while it runs.
import base64
import json
import os
import re
import subprocess
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

import r3
import r3.staging
from helpers import prompt, read_safetensors

ENGINE = dict(num_kv_blocks=128, threads=1, max_num_batched_tokens=64, max_num_seqs=8)


@pytest.fixture(scope="module")
def model(make_model):
    return make_model("olmoe")


@pytest.fixture(scope="module")
def llm(model):
    return r3.LLM(model=model, enable_return_routed_experts=True, **ENGINE)


@pytest.fixture(scope="module")
def solo(model):
    return r3.LLM(model=model, enable_return_routed_experts=True, enable_prefix_caching=False, max_num_seqs=1,
                  max_num_batched_tokens=4096, num_kv_blocks=128, threads=1)


def test_generate_returns_tokens_logprobs_and_routes(llm):
    cfg = llm.model_config
    prompts = [{"prompt_token_ids": prompt(20, 1)}, {"prompt_token_ids": prompt(70, 2)}]
    outs = llm.generate(prompts, r3.SamplingParams(max_tokens=9, temperature=1.0, seed=5, ignore_eos=True))
    assert len(outs) == 2
    for o, p in zip(outs, prompts):
        c = o.outputs[0]
        assert o.prompt_token_ids == p["prompt_token_ids"]
        assert len(c.token_ids) == 9 and c.finish_reason == "length"
        assert len(c.logprobs) == 9 and all(lp <= 0 for lp in c.logprobs)
        re_ = c.routed_experts
        assert isinstance(re_, np.ndarray) and re_.dtype == np.int16
        S = len(p["prompt_token_ids"]) + len(c.token_ids)
        assert re_.shape == (S - 1, len(cfg["moe_layers"]), cfg["top_k"])
        assert re_.min() >= 0 and re_.max() < cfg["num_experts"]
        assert c.moe_layers == cfg["moe_layers"]
        assert o.routed_experts is c.routed_experts or np.array_equal(o.routed_experts, re_)


def test_batched_equals_solo_runs(llm, solo):
    prompts = [{"prompt_token_ids": prompt(5 + 9 * i, 10 + i)} for i in range(6)]
    params = [r3.SamplingParams(max_tokens=4 + i, temperature=0.9, top_p=0.95, seed=100 + i) for i in range(6)]
    batched = llm.generate(prompts, params)
    for p, sp, b in zip(prompts, params, batched):
        s = solo.generate([p], sp)[0]
        assert b.outputs[0].token_ids == s.outputs[0].token_ids
        assert b.outputs[0].logprobs == s.outputs[0].logprobs
        assert np.array_equal(b.outputs[0].routed_experts, s.outputs[0].routed_experts)


def test_gate_weights_come_with_the_routes_when_asked(llm, solo, model):
    """SamplingParams(return_routed_expert_weights=True): float32 weights of the routes' shape,
    rows and order, bitwise the solo run's (batched, with prefix hits), split as the routes are in
    the vllm layout; None unless asked; asking without routes is an error naming it."""
    prompts = [{"prompt_token_ids": prompt(40, 7)[:20 + 5 * i]} for i in range(4)]  # shared prefixes
    sp = r3.SamplingParams(max_tokens=7, temperature=0.9, seed=11, return_routed_expert_weights=True)
    assert sp.return_routed_expert_weights
    batched = llm.generate(prompts, sp)
    for p, b in zip(prompts, batched):
        c = b.outputs[0]
        s = solo.generate([p], sp)[0].outputs[0]
        assert c.routed_expert_weights.dtype == np.float32
        assert c.routed_expert_weights.shape == c.routed_experts.shape
        assert c.routed_expert_weights.tobytes() == s.routed_expert_weights.tobytes()
        assert np.all(c.routed_expert_weights > 0)
        P = len(p["prompt_token_ids"])
        assert np.array_equal(b.prompt_routed_expert_weights, c.routed_expert_weights[:P])
    assert llm.generate(prompts[:1], r3.SamplingParams(max_tokens=3))[0].outputs[0].routed_expert_weights is None
    vllm = r3.LLM(model=model, enable_return_routed_experts=True, routed_experts_format="vllm", **ENGINE)
    v = vllm.generate(prompts[:1], sp)[0]
    P = len(prompts[0]["prompt_token_ids"])
    assert np.array_equal(v.prompt_routed_expert_weights, batched[0].outputs[0].routed_expert_weights[:P])
    assert np.array_equal(v.outputs[0].routed_expert_weights, batched[0].outputs[0].routed_expert_weights[P:])
    with pytest.raises(r3.Error, match="return_routed_expert_weights needs return_routed_experts"):
        llm.generate(prompts[:1], r3.SamplingParams(return_routed_experts=False, return_routed_expert_weights=True))


def test_delta_start_and_routes_off(llm):
    p = prompt(30, 3)
    full = llm.generate([{"prompt_token_ids": p}], r3.SamplingParams(max_tokens=6, seed=1))[0].outputs[0]
    tail = llm.generate([{"prompt_token_ids": p}], r3.SamplingParams(max_tokens=6, seed=1, routed_experts_start=20))
    t = tail[0].outputs[0]
    assert t.routed_experts_start == 20
    assert np.array_equal(t.routed_experts, full.routed_experts[20:])
    off = llm.generate([{"prompt_token_ids": p}], r3.SamplingParams(max_tokens=6, seed=1, return_routed_experts=False))
    assert off[0].outputs[0].routed_experts is None
    assert off[0].outputs[0].token_ids == full.token_ids
    # vLLM's name for the cut: the same rows; the prompt's end returns none of its rows; past it, or
    # beside routed_experts_start, an error naming it.
    vllm = llm.generate([{"prompt_token_ids": p}], r3.SamplingParams(max_tokens=6, seed=1, routed_experts_prompt_start=20))
    assert np.array_equal(vllm[0].outputs[0].routed_experts, t.routed_experts)
    end = llm.generate([{"prompt_token_ids": p}], r3.SamplingParams(max_tokens=6, seed=1, routed_experts_prompt_start=30))
    assert np.array_equal(end[0].outputs[0].routed_experts, full.routed_experts[30:])
    with pytest.raises(r3.Error, match="routed_experts_prompt_start 31 is past the prompt's 30 tokens"):
        llm.generate([{"prompt_token_ids": p}], r3.SamplingParams(max_tokens=6, routed_experts_prompt_start=31))
    with pytest.raises(r3.Error, match="give one of routed_experts_start and routed_experts_prompt_start"):
        r3.SamplingParams(routed_experts_start=3, routed_experts_prompt_start=3)


def start_server(r3_bin, model, routes=True, extra=()):
    flags = ["--enable-return-routed-experts"] if routes else []
    proc = subprocess.Popen([r3_bin, "serve", "--model", model, "--port", "0", "--threads", "1",
                             "--num-kv-blocks", "128"] + flags + list(extra), stderr=subprocess.PIPE, text=True)
    line = proc.stderr.readline()
    m = re.search(r"http://127\.0\.0\.1:(\d+)", line)
    assert m, line
    return proc, int(m.group(1))


def test_routes_equal_the_http_path(llm, model, r3_bin):
    proc, port = start_server(r3_bin, model)
    try:
        p = prompt(45, 4)
        body = {"input_ids": p, "sampling_params": {"max_new_tokens": 10, "temperature": 1.0, "seed": 77},
                "return_routed_experts": True}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(req, timeout=60).read())
        # The gate weights in every format, read back by r3.staging.decode_route_weights.
        weights = {}
        for fmt in ("sglang", "vllm", "r3", "nrlre1"):
            body = {**body, "return_routed_expert_weights": True, "routed_experts_format": fmt}
            req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            weights[fmt] = json.loads(urllib.request.urlopen(req, timeout=60).read())["meta_info"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    # Decoded the way slime decodes SGLang's routes: base64 -> int32 -> [len(tokens)-1, num_layers, topk]
    # (every layer of the tiny OLMoE is an MoE layer, so the layer axes agree).
    assert reply["meta_info"]["routed_experts_format"] == "sglang"
    tokens = p + reply["output_ids"]
    cfg = llm.model_config
    http_routes = np.frombuffer(base64.b64decode(reply["meta_info"]["routed_experts"]), dtype=np.int32).reshape(
        len(tokens) - 1, cfg["num_layers"], cfg["top_k"])
    out = llm.generate([{"prompt_token_ids": p}], r3.SamplingParams(max_tokens=10, temperature=1.0, seed=77))[0]
    c = out.outputs[0]
    assert reply["output_ids"] == c.token_ids
    assert [lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]] == c.logprobs
    assert np.array_equal(http_routes, c.routed_experts)
    want = llm.generate([{"prompt_token_ids": p}], r3.SamplingParams(max_tokens=10, temperature=1.0, seed=77,
                                                                     return_routed_expert_weights=True))[0]
    want = want.outputs[0].routed_expert_weights
    for fmt, meta in weights.items():
        if fmt == "vllm":
            got = np.concatenate([r3.staging.decode_route_weights(meta["prompt_routed_expert_weights"], fmt),
                                  r3.staging.decode_route_weights(meta["routed_expert_weights"], fmt)])
        else:
            got = r3.staging.decode_route_weights(meta["routed_expert_weights"], fmt,
                                                  num_hidden_layers=cfg["num_layers"], top_k=cfg["top_k"],
                                                  moe_layers=cfg["moe_layers"])
        assert got.dtype == np.float32 and got.tobytes() == want.tobytes(), fmt


def test_update_weights(model, make_model):
    m1 = make_model("olmoe", seed=1)
    llm = r3.LLM(model=model, enable_return_routed_experts=True, **ENGINE)
    p = [{"prompt_token_ids": prompt(25, 5)}]
    sp = r3.SamplingParams(max_tokens=8, seed=2)
    before = llm.generate(p, sp)[0].outputs[0]
    assert llm.weight_version == 0
    llm.update_weights(m1)
    assert llm.weight_version == 1
    after = llm.generate(p, sp)[0].outputs[0]
    assert after.weight_versions == [1] * len(after.token_ids)
    fresh = r3.LLM(model=m1, enable_return_routed_experts=True, **ENGINE).generate(p, sp)[0].outputs[0]
    assert after.token_ids == fresh.token_ids
    assert np.array_equal(after.routed_experts, fresh.routed_experts)
    assert after.token_ids != before.token_ids or not np.array_equal(after.routed_experts, before.routed_experts)
    with pytest.raises(r3.Error):
        llm.update_weights(make_model("mixtral"))
    with pytest.raises(r3.Error):
        llm.update_weights("/no/such/checkpoint")


def test_refit_with_another_description_is_refused(model, tmp_path):
    # Same tensors, rope_theta doubled: the refit names the key and the old weights keep serving.
    import shutil
    llm = r3.LLM(model=model, **ENGINE)
    p = [{"prompt_token_ids": prompt(12, 9)}]
    sp = r3.SamplingParams(max_tokens=6, seed=4, ignore_eos=True)
    before = llm.generate(p, sp)[0].outputs[0]
    other = tmp_path / "other"
    shutil.copytree(model, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["rope_theta"] = cfg.get("rope_theta", 10000.0) * 2
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(r3.Error, match="rope_theta"):
        llm.update_weights(str(other))
    assert llm.weight_version == 0
    after = llm.generate(p, sp)[0].outputs[0]
    assert after.token_ids == before.token_ids and after.logprobs == before.logprobs


def test_errors(model, llm):
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["some text"])
    with pytest.raises(r3.Error, match="vocabulary"):
        llm.generate([{"prompt_token_ids": [1, 100000]}])
    with pytest.raises(r3.Error):
        llm.generate([{"prompt_token_ids": [1, 2]}], r3.SamplingParams(top_p=0.0))
    with pytest.raises(TypeError):
        r3.LLM(model=model, gpu_memory_utilization=0.9)
    with pytest.raises(r3.Error, match="kv_cache_dtype must be auto, bf16 or fp32"):
        r3.LLM(model=model, kv_cache_dtype="fp8", **ENGINE)
    plain = r3.LLM(model=model, **ENGINE)
    with pytest.raises(r3.Error, match="enable_return_routed_experts"):
        plain.generate([{"prompt_token_ids": [1, 2]}], r3.SamplingParams(return_routed_experts=True))
    assert plain.generate([{"prompt_token_ids": [1, 2]}])[0].outputs[0].routed_experts is None


def test_kv_cache_dtype(model, llm):
    # An fp32 cache serves the same requests; greedy tokens agree with the bf16 default's except
    # where the cache rounding tips a near-tie, so only the shape is compared.
    fp32 = r3.LLM(model=model, kv_cache_dtype="fp32", **ENGINE)
    assert fp32.stats()["kv_cache_dtype"] == "fp32"
    assert llm.stats()["kv_cache_dtype"] == "bf16"  # auto, for this bf16 checkpoint
    sp = r3.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for engine in (fp32, llm):
        out = engine.generate([{"prompt_token_ids": prompt(20, 7)}], sp)[0].outputs[0]
        assert len(out.token_ids) == 6


def test_gil_released_while_generating(llm):
    done = threading.Event()

    def run():
        llm.generate([{"prompt_token_ids": prompt(10, 6)}], r3.SamplingParams(max_tokens=1500, ignore_eos=True))
        done.set()

    t = threading.Thread(target=run)
    ticks = 0
    t.start()
    start = time.monotonic()
    while not done.is_set():
        ticks += 1
    elapsed = time.monotonic() - start
    t.join()
    # With the GIL held for the whole generate this thread could not run while it did.
    assert elapsed > 0.01 and ticks > 1000, (elapsed, ticks)


def test_unseeded_samples_differ_and_seeded_repeat(llm):
    # vLLM's default: no seed means a fresh random seed per request, so a temperature-1 batch of
    # one prompt gives different samples; a fixed seed repeats exactly.
    p = {"prompt_token_ids": prompt(12, 7)}
    outs = llm.generate([p] * 6, r3.SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True))
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) > 1
    assert r3.SamplingParams().seed is None
    sp = r3.SamplingParams(max_tokens=12, temperature=1.0, seed=11, ignore_eos=True)
    a, b = llm.generate([p], sp)[0], llm.generate([p], sp)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_bad_prompt_in_a_batch_leaves_the_llm_usable(llm):
    # One out-of-vocabulary prompt refuses the whole call; the valid prompts queued before it are
    # withdrawn, so the next call answers exactly its own prompts.
    vocab = llm.model_config["vocab_size"]
    good = {"prompt_token_ids": prompt(8, 3)}
    with pytest.raises(r3.Error, match="vocabulary"):
        llm.generate([good, good, {"prompt_token_ids": [1, vocab + 5]}], r3.SamplingParams(max_tokens=4))
    for _ in range(2):
        outs = llm.generate([good], r3.SamplingParams(max_tokens=4, seed=1, ignore_eos=True))
        assert len(outs) == 1 and len(outs[0].outputs[0].token_ids) == 4
    assert llm.stats()["running"] == 0 and llm.stats()["waiting"] == 0


def test_sigterm_drains_requests_in_flight(r3_bin, tmp_path):
    # `r3 serve` on SIGTERM: the request in flight finishes normally (not an error) and the
    # process exits 0. The small preset decodes 2000 tokens in about a second.
    small = str(tmp_path / "small")
    subprocess.run([r3_bin, "make-model", "--arch", "olmoe", "--preset", "small", "--out", small], check=True,
                   stdout=subprocess.DEVNULL)
    proc, port = start_server(r3_bin, small)
    result = {}

    def call():
        body = {"input_ids": prompt(10, 6), "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            result["reply"] = json.loads(urllib.request.urlopen(req, timeout=60).read())
        except Exception as e:  # noqa: BLE001 - recorded and asserted below
            result["error"] = repr(e)

    t = threading.Thread(target=call)
    t.start()
    for _ in range(500):  # wait until it runs
        m = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        if "\nr3_requests_running 1" in m:
            break
        time.sleep(0.005)
    assert "\nr3_requests_running 1" in m
    proc.terminate()
    t.join(timeout=60)
    assert proc.wait(timeout=60) == 0
    assert "reply" in result, result
    assert result["reply"]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(result["reply"]["output_ids"]) == 2000


def test_update_weights_from_tensors_in_buckets(model, make_model):
    m1 = make_model("olmoe", seed=1)
    llm = r3.LLM(model=model, enable_return_routed_experts=True, **ENGINE)
    tensors = read_safetensors(os.path.join(m1, "model.safetensors"))
    names = sorted(tensors)
    p = [{"prompt_token_ids": prompt(15, 3)}]
    sp = r3.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    before = llm.generate(p, sp)[0].outputs[0]
    assert llm.update_weights_from_tensors({k: tensors[k] for k in names[::2]}, finished=False) == len(names[::2])
    assert llm.weight_version == 0
    # Applied in place: nothing runs on a half-applied refit.
    with pytest.raises(r3.Error, match="refit in buckets is under way"):
        llm.generate(p, sp)
    assert llm.update_weights_from_tensors([(k, tensors[k]) for k in names[1::2]]) == len(names)
    assert llm.weight_version == 1
    got = llm.generate(p, sp)[0].outputs[0]
    fresh = r3.LLM(model=m1, enable_return_routed_experts=True, **ENGINE).generate(p, sp)[0].outputs[0]
    assert got.token_ids == fresh.token_ids and got.logprobs == fresh.logprobs
    assert np.array_equal(got.routed_experts, fresh.routed_experts)
    assert got.logprobs != before.logprobs  # the refit took effect (other seed, other weights)
    with pytest.raises(r3.Error, match="not in the served model"):
        llm.update_weights_from_tensors({"no.such.weight": np.zeros(4, np.float32)})
    with pytest.raises(r3.Error, match="buffer format"):
        llm.update_weights_from_tensors({names[0]: np.zeros(4, np.float64)})
    assert llm.weight_version == 1


def test_vllm_sampling_options_n_logprobs_prompt_logprobs(llm):
    # n samples per prompt (seed + j), logprobs=k (top alternatives per generated token, the
    # sampled one included), prompt_logprobs=k (vLLM's list: None, then {id: logprob} per
    # position) and the prompt part of the routes.
    p = prompt(14, 2)
    sp = r3.SamplingParams(max_tokens=6, temperature=1.0, seed=40, n=3, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": p}], sp)
    assert len(out) == 1 and [c.index for c in out[0].outputs] == [0, 1, 2]
    for j, c in enumerate(out[0].outputs):
        one = llm.generate([{"prompt_token_ids": p}], r3.SamplingParams(max_tokens=6, temperature=1.0, seed=40 + j,
                                                                       ignore_eos=True))[0].outputs[0]
        assert c.token_ids == one.token_ids and c.logprobs == one.logprobs
        assert len(c.top_logprobs) == 6
        for t, lp, d in zip(c.token_ids, c.logprobs, c.top_logprobs):
            assert d[t] == lp and 2 <= len(d) <= 3 and all(v <= 0 for v in d.values())
    pl = out[0].prompt_logprobs
    assert len(pl) == len(p) and pl[0] is None
    assert all(p[i] in pl[i] for i in range(1, len(p)))
    cfg = llm.model_config
    assert out[0].prompt_routed_experts.shape == (len(p), len(cfg["moe_layers"]), cfg["top_k"])
    assert np.array_equal(out[0].prompt_routed_experts, out[0].outputs[0].routed_experts[:len(p)])
    # Scoring a sequence: its prompt logprobs are the logprobs it was generated with.
    g = llm.generate([{"prompt_token_ids": p}], r3.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    seq = p + g.outputs[0].token_ids
    sc = llm.generate([{"prompt_token_ids": seq}], r3.SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    assert sc.outputs[0].token_ids == []
    assert [sc.prompt_logprobs[len(p) + i][t] for i, t in enumerate(g.outputs[0].token_ids)] == g.outputs[0].logprobs


def test_serve_captures_routes_only_when_started_with_it(r3_bin, model):
    # Route capture is opt-in at launch, as in SGLang and vLLM: asking a server started without
    # it is a 400 naming the field, not an empty answer.
    proc, port = start_server(r3_bin, model, routes=False)
    try:
        body = {"input_ids": prompt(5, 1), "sampling_params": {"max_new_tokens": 2}, "return_routed_experts": True}
        req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 400
        assert json.loads(err.value.read())["error"]["param"] == "return_routed_experts"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_vllm_routed_experts_split(model, llm):
    # routed_experts_format="vllm": the output holds the generated rows [P, S-1), the prompt rows
    # [0, P) are RequestOutput.prompt_routed_experts; together they are r3's S-1 rows.
    v = r3.LLM(model=model, enable_return_routed_experts=True, routed_experts_format="vllm", **ENGINE)
    p = [{"prompt_token_ids": prompt(11, 4)}]
    sp = r3.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    a, b = v.generate(p, sp)[0], llm.generate(p, sp)[0]
    assert a.outputs[0].routed_experts.shape[0] == 5 - 1
    assert a.prompt_routed_experts.shape[0] == 11
    assert np.array_equal(np.concatenate([a.prompt_routed_experts, a.outputs[0].routed_experts]),
                          b.outputs[0].routed_experts)
    with pytest.raises(r3.Error, match="routed_experts_format"):
        r3.LLM(model=model, routed_experts_format="sglang", **ENGINE)


def test_update_weights_from_tensors_of_an_fp8_model(r3_bin, tmp_path):
    # FP8 codes go as uint8 (numpy has no float8), their block scales as float32: the refit
    # equals a fresh engine on the new checkpoint; a NaN code is refused and changes nothing.
    import subprocess
    for seed in (0, 1):
        subprocess.run([r3_bin, "make-model", "--arch", "deepseek_v3", "--quant", "fp8", "--fp8-block", "32x48",
                        "--seed", str(seed), "--out", str(tmp_path / str(seed))], check=True, stdout=subprocess.DEVNULL)
    llm = r3.LLM(model=str(tmp_path / "0"), enable_return_routed_experts=True, **ENGINE)
    tensors = read_safetensors(str(tmp_path / "1" / "model.safetensors"))
    assert tensors["model.layers.1.self_attn.o_proj.weight"].dtype == np.uint8
    p = [{"prompt_token_ids": prompt(15, 3)}]
    sp = r3.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    bad = tensors["model.layers.1.self_attn.o_proj.weight"].copy()
    bad.flat[5] = 0x7F
    before = llm.generate(p, sp)[0].outputs[0]
    with pytest.raises(r3.Error, match="NaN"):
        llm.update_weights_from_tensors({"model.layers.1.self_attn.o_proj.weight": bad})
    assert llm.generate(p, sp)[0].outputs[0].logprobs == before.logprobs
    assert llm.update_weights_from_tensors(tensors) == len(tensors)
    got = llm.generate(p, sp)[0].outputs[0]
    fresh = r3.LLM(model=str(tmp_path / "1"), enable_return_routed_experts=True, **ENGINE).generate(p, sp)[0].outputs[0]
    assert got.token_ids == fresh.token_ids and got.logprobs == fresh.logprobs
    assert np.array_equal(got.routed_experts, fresh.routed_experts)


def test_speculative_decoding_changes_nothing_but_speed(model, solo):
    """LLM(speculative_algorithm="NGRAM"): tokens, logprobs, top logprobs and routes (with gate
    weights) bitwise the solo run's without speculation, greedy and sampled, on prompts whose
    drafts can be right; stats() counts drafted and accepted tokens; bad settings are errors."""
    spec = r3.LLM(model=model, enable_return_routed_experts=True, speculative_algorithm="NGRAM",
                  speculative_num_draft_tokens=3, **ENGINE)
    prompts = [{"prompt_token_ids": prompt(12, 40 + i) * 3} for i in range(4)]
    params = [r3.SamplingParams(max_tokens=24, temperature=t, seed=9 + i, ignore_eos=True, logprobs=2,
                                return_routed_expert_weights=True)
              for i, t in enumerate([0.0, 0.0, 0.8, 1.0])]
    got = spec.generate(prompts, params)
    for p, sp, g in zip(prompts, params, got):
        s = solo.generate([p], sp)[0].outputs[0]
        c = g.outputs[0]
        assert c.token_ids == s.token_ids
        assert c.logprobs == s.logprobs
        assert c.top_logprobs == s.top_logprobs
        assert np.array_equal(c.routed_experts, s.routed_experts)
        assert c.routed_expert_weights.tobytes() == s.routed_expert_weights.tobytes()
    st = spec.stats()
    assert st["spec_draft_tokens"] > 0 and 0 < st["spec_accepted_tokens"] <= st["spec_draft_tokens"]
    assert st["spec_acceptance_rate"] == st["spec_accepted_tokens"] / st["spec_draft_tokens"]
    with pytest.raises(r3.Error, match="speculative_algorithm must be NGRAM"):
        r3.LLM(model=model, speculative_algorithm="LOOKAHEAD", **ENGINE)
    with pytest.raises(r3.Error, match="overlap scheduler"):
        r3.LLM(model=model, speculative_algorithm="NGRAM", overlap_scheduler=True, **ENGINE)


def test_served_with_speculation_as_without(llm, model, r3_bin):
    """r3 serve --speculative-algorithm NGRAM: /generate gives the tokens, logprobs and routes of
    the engine without speculation; /metrics counts the drafts and /get_server_info names it."""
    proc, port = start_server(r3_bin, model, extra=["--speculative-algorithm", "NGRAM",
                                                    "--speculative-num-draft-tokens", "3"])
    url = f"http://127.0.0.1:{port}"
    try:
        p = prompt(9, 5) * 3
        body = {"input_ids": p, "sampling_params": {"max_new_tokens": 24, "temperature": 0.0, "ignore_eos": True},
                "return_routed_experts": True}
        req = urllib.request.Request(f"{url}/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(req, timeout=60).read())
        metrics = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
        info = json.loads(urllib.request.urlopen(f"{url}/get_server_info", timeout=10).read())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    want = llm.generate([{"prompt_token_ids": p}], r3.SamplingParams(max_tokens=24, temperature=0.0,
                                                                     ignore_eos=True))[0].outputs[0]
    assert reply["output_ids"] == want.token_ids
    assert [lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]] == want.logprobs
    cfg = llm.model_config
    routes = np.frombuffer(base64.b64decode(reply["meta_info"]["routed_experts"]), dtype=np.int32)
    assert np.array_equal(routes.reshape(-1, cfg["num_layers"], cfg["top_k"]), want.routed_experts)
    drafted = float(re.search(r"^r3_spec_decode_num_draft_tokens_total (\S+)$", metrics, re.M).group(1))
    accepted = float(re.search(r"^r3_spec_decode_num_accepted_tokens_total (\S+)$", metrics, re.M).group(1))
    assert drafted > 0 and 0 <= accepted <= drafted
    assert info["speculative_algorithm"] == "NGRAM" and info["speculative_num_draft_tokens"] == 3


def test_model_config_is_the_whole_description(llm):
    """LLM.model_config is every field of r3's description (visit_fields), nested by its dotted
    name, beside the flat names callers already read."""
    cfg = llm.model_config
    assert len(cfg["layers"]) == cfg["num_layers"]
    assert cfg["moe_layers"] == [i for i, layer in enumerate(cfg["layers"]) if layer["moe"]]
    assert cfg["router"]["renormalize"] == cfg["renormalize"]
    assert cfg["router"]["routed_scaling_factor"] == cfg["routed_scaling_factor"]
    assert set(cfg["layers"][0]["attention"]) >= {"kind", "rotary_dim", "sliding_window", "clip_qkv"}
    assert set(cfg["rope_scaling"]) >= {"yarn", "factor"}

