"""r3.staging from Python: the staging document's two-call example (as tests/staging_test.cc
has it), random multi-turn rollouts against their ground truth, both policies, the fillers, every
wire format round-tripping and staging to the same rows, NeMo-RL's validation, and the alignment
metrics."""
import random

import numpy as np
import pytest

import r3
from r3 import staging

E, L, K = 64, 2, 6
MOE_LAYERS = [1, 3]
NUM_HIDDEN = 4


def truth(total):
    """Ground-truth routes of positions [0, total): distinct ids per (position, layer)."""
    t = np.zeros((total, L, K), dtype=np.int32)
    for p in range(total):
        for l in range(L):
            base = (p * 7 + l * 13) % E
            t[p, l] = [(base + j) % E for j in range(K)]
    return t


def reply(total, start):
    """What the engine returns for a call of `total` tokens from position `start`: rows [start, total-1)."""
    return truth(total)[start:total - 1]


def test_two_call_example_with_and_without_boundary_repair():
    for filler in ("minus_one", "arange"):
        c1 = staging.stage_call(reply(7, 0), 0, 7, E, filler=filler, call_index=1)
        c2 = staging.stage_call(reply(24, 0), 7, 24, E, filler=filler, call_index=2)
        assert c1.rows.shape == (7, L, K) and c2.rows.shape == (17, L, K)
        assert c1.ok and c2.ok and c1.filler_rows == 1 and c2.filler_rows == 1
        fill = -1 if filler == "minus_one" else np.arange(K)
        assert (c1.rows[6] == fill).all() and (c2.rows[16] == fill).all()
        rows, rep = staging.assemble_rollout([c1, c2])
        assert rows.shape == (24, L, K)
        assert rep == {"repaired_boundary_rows": 1, "filler_rows": 1, "versions": [], "mixed_versions": False,
                       "version_dropped_calls": 0}  # staged without weight versions: none known
        np.testing.assert_array_equal(rows[:23], truth(24)[:23])  # position 6 repaired from call 2's reply
        assert (rows[23] == fill).all()
        plain, rep = staging.assemble_rollout([c1, c2], repair_boundaries=False)
        assert rep == {"repaired_boundary_rows": 0, "filler_rows": 2, "versions": [], "mixed_versions": False,
                       "version_dropped_calls": 0}
        assert (plain[6] == fill).all()
    # A delta reply from prev_len - 1 repairs too; one from prev_len cannot.
    c1 = staging.stage_call(reply(7, 0), 0, 7, E)
    for start, repaired in ((6, 1), (7, 0)):
        c2 = staging.stage_call(reply(24, start), 7, 24, E, start=start)
        rows, rep = staging.assemble_rollout([c1, c2])
        assert rep["repaired_boundary_rows"] == repaired


def test_policies_strict_raises_lenient_drops_the_call_with_a_warning():
    bad = reply(24, 0)[:-3]  # three rows short
    with pytest.raises(r3.Error, match="call 2"):
        staging.stage_call(bad, 7, 24, E, call_index=2)
    with pytest.warns(RuntimeWarning, match="call 2"):
        c = staging.stage_call(bad, 7, 24, E, policy="lenient", call_index=2)
    assert not c.ok and (c.rows == -1).all() and c.rows.shape == (17, L, K)
    # An all -1 engine row: strict fails, lenient drops.
    r = reply(24, 0).copy()
    r[10] = -1
    with pytest.raises(r3.Error):
        staging.stage_call(r, 7, 24, E)
    with pytest.warns(RuntimeWarning):
        assert not staging.stage_call(r, 7, 24, E, policy="lenient").ok
    with pytest.raises(r3.Error, match="filler"):
        staging.stage_call(reply(7, 0), 0, 7, E, filler="zeros")


def test_random_multi_turn_rollouts_match_their_ground_truth():
    rng = random.Random(3)
    for _ in range(40):
        turns = rng.randint(1, 5)
        lens, total = [], rng.randint(2, 12)
        for _t in range(turns):
            lens.append(total)
            total += rng.randint(1, 9) + rng.randint(1, 9)  # user tokens + generated
        lens = lens[1:] + [total]
        calls, prev = [], 0
        for i, T in enumerate(lens):
            start = 0 if i == 0 else rng.choice([0, prev - 1, prev])
            calls.append(staging.stage_call(reply(T, start), prev, T, E, start=start, filler="spread", call_index=i))
            prev = T
        rows, rep = staging.assemble_rollout(calls)
        gt = truth(lens[-1])
        assert rows.shape == gt.shape
        for p in range(lens[-1]):
            boundary_kept = p + 1 in lens[:-1] and rep["filler_rows"] > 1
            if p == lens[-1] - 1 or boundary_kept and not (rows[p] == gt[p]).all():
                assert staging.validate_routes(rows[p:p + 1], E) == []  # spread filler: valid forced ids
            else:
                np.testing.assert_array_equal(rows[p], gt[p])


def test_spread_filler_moves_with_position_and_layer():
    firsts = set()
    for T in (7, 8, 9, 24):
        c = staging.stage_call(reply(T, 0), 0, T, E, filler="spread")
        last = c.rows[-1]
        assert staging.validate_routes(last[None], E) == []
        firsts.update(int(x) for x in last[:, 0])
    assert len(firsts) > 4


def test_every_format_round_trips_and_stages_to_the_same_rows():
    moe = reply(24, 0)
    full = staging.all_layers(moe, MOE_LAYERS, NUM_HIDDEN)
    assert full.shape == (23, NUM_HIDDEN, K) and (full[:, [0, 2]] == 0).all()
    np.testing.assert_array_equal(staging.moe_layers_only(full, MOE_LAYERS), moe)
    payloads = {
        "sglang": staging.encode_routes(moe, "sglang", moe_layers=MOE_LAYERS, num_hidden_layers=NUM_HIDDEN),
        "vllm": staging.encode_routes(moe, "vllm"),
        "r3": staging.encode_routes(moe, "r3", moe_layers=MOE_LAYERS),
        "nrlre1": staging.encode_routes(moe, "nrlre1"),
    }
    assert payloads["nrlre1"].startswith("nrlre1:int8:23x2x6:")
    staged = []
    for fmt, payload in payloads.items():
        got = staging.decode_routes(payload, fmt, num_hidden_layers=NUM_HIDDEN, top_k=K, moe_layers=MOE_LAYERS)
        np.testing.assert_array_equal(got, moe, err_msg=fmt)
        staged.append(staging.stage_call(got, 7, 24, E).rows)
    for s in staged[1:]:
        np.testing.assert_array_equal(s, staged[0])
    every = staging.decode_routes(payloads["sglang"], "sglang", num_hidden_layers=NUM_HIDDEN, top_k=K)
    np.testing.assert_array_equal(every, full)
    with pytest.raises(r3.Error, match="unknown route format"):
        staging.decode_routes("x", "megatron")
    with pytest.raises(r3.Error):
        staging.decode_routes("nrlre1:int8:2x2:AAAA", "nrlre1")


def test_wide_expert_counts_round_trip_in_every_format_with_the_narrowest_stated_type():
    """512 experts (Qwen3.5-397B) at top-10 and top-22, and 200 experts: every format round-trips and
    stages alike; the self-describing payloads state the narrowest type the ids fit (uint8 for
    200, int16 for 512), never one that would wrap them (prime-rl #3051)."""
    import base64
    import io
    rng = np.random.default_rng(512)
    for experts, k, narrow in ((512, 10, "int16"), (512, 22, "int16"), (200, 10, "uint8")):
        moe = np.stack([np.stack([rng.choice(experts, k, replace=False) for _ in MOE_LAYERS]) for _ in range(17)])
        moe[0, 0, 0] = experts - 1
        payloads = {
            "sglang": staging.encode_routes(moe, "sglang", moe_layers=MOE_LAYERS, num_hidden_layers=NUM_HIDDEN),
            "vllm": staging.encode_routes(moe, "vllm"),
            "r3": staging.encode_routes(moe, "r3", moe_layers=MOE_LAYERS),
            "nrlre1": staging.encode_routes(moe, "nrlre1"),
        }
        assert payloads["r3"]["dtype"] == narrow
        assert np.load(io.BytesIO(base64.b64decode(payloads["vllm"]))).dtype == np.dtype(narrow)
        staged = []
        for fmt, payload in payloads.items():
            got = staging.decode_routes(payload, fmt, num_hidden_layers=NUM_HIDDEN, top_k=k, moe_layers=MOE_LAYERS)
            np.testing.assert_array_equal(got, moe, err_msg=f"{fmt} {experts}x{k}")
            staged.append(staging.stage_call(got, 5, 18, experts).rows)
        for s in staged[1:]:
            np.testing.assert_array_equal(s, staged[0])


def test_validation_as_nemo_rl_applies_it():
    r = reply(10, 0).copy()
    assert staging.validate_routes(r, E) == []
    r[1, 0, 0] = -1
    r[2, 1, 3] = E
    r[3, 0, 1] = r[3, 0, 0]
    r[4] = -1  # a whole -1 row is allowed
    problems = staging.validate_routes(r, E)
    assert any("row 1 is partly -1" in p for p in problems)
    assert any("row 2 layer 1" in p and "outside" in p for p in problems)
    assert any("row 3 layer 0 repeats" in p for p in problems)
    assert not any("row 4" in p for p in problems)


def test_alignment_metrics_from_arrays():
    eng = reply(5, 0)
    same = staging.alignment_metrics(eng, eng, [-1.0] * 4, [-1.0] * 4)
    assert same["router_disagreement_pairs"] == 0 and same["k3_kl"] == 0 and same["tokens"] == 4
    other = eng.copy()
    other[0, 0, 0] = (eng[0, 0].max() + 1) % E  # one (token, layer) set differs
    m = staging.alignment_metrics(eng, other, [-1.0, -2.0, -1.0, -1.0], [-1.0, -1.0, -1.0, -1.0])
    assert m["router_disagreement_pairs"] == pytest.approx(1 / 8)
    assert m["router_disagreement_tokens"] == pytest.approx(1 / 4)
    r = np.exp(-1.0 - -2.0)
    assert m["k3_kl"] == pytest.approx((r - 1 - np.log(r)) / 4)
    assert m["extreme_token_fraction"] == pytest.approx(1 / 4)


def test_a_rollout_across_a_refit_is_reported_and_the_version_policy_decides(make_model):
    """Two turns of one rollout on a real engine with a refit between them (asynchronous RL): the
    rows of turn 1 are version 0, turn 2's version 1. keep reports the mix and keeps every row;
    drop_call makes turn 1's routes -1; fail raises naming the versions."""
    model = make_model("olmoe")
    llm = r3.LLM(model=model, enable_return_routed_experts=True, num_kv_blocks=128, threads=1)
    num_experts = llm.model_config["num_experts"]
    rng = random.Random(45)
    turn1 = [rng.randrange(3, 200) for _ in range(20)]
    sp = r3.SamplingParams(max_tokens=6, seed=3, ignore_eos=True)
    a = llm.generate([{"prompt_token_ids": turn1}], sp)[0].outputs[0]
    llm.update_weights(make_model("olmoe", seed=1))
    turn2 = turn1 + a.token_ids + [rng.randrange(3, 200) for _ in range(5)]
    b = llm.generate([{"prompt_token_ids": turn2}], r3.SamplingParams(max_tokens=6, seed=4, ignore_eos=True,
                                                                      routed_experts_start=len(turn1) + 5))[0].outputs[0]
    assert set(a.weight_versions) == {0} and set(b.weight_versions) == {1}
    t1, t2 = len(turn1) + 6, len(turn2) + 6
    calls = [staging.stage_call(a.routed_experts, 0, t1, num_experts, weight_versions=a.weight_versions),
             staging.stage_call(b.routed_experts, t1, t2, num_experts, start=len(turn1) + 5, call_index=1,
                                weight_versions=b.weight_versions)]
    assert calls[0].versions == [0] * t1 and calls[1].versions == [1] * (t2 - t1)
    rows, report = staging.assemble_rollout(calls)
    assert report["mixed_versions"] and report["versions"] == [0] * (t1 - 1) + [1] * (t2 - t1 + 1)
    assert (rows[:t1 - 1] == a.routed_experts[:t1 - 1]).all()
    dropped, report = staging.assemble_rollout(calls, version_policy="drop_call")
    assert report["version_dropped_calls"] == 1
    assert (dropped[:t1] == -1).all() and (dropped[t1:] == rows[t1:]).all()
    with pytest.raises(r3.Error, match="span weight versions 0 to 1"):
        staging.assemble_rollout(calls, version_policy="fail")
