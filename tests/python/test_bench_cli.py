"""r3 bench reports medians and spreads against limits measured several times in the run, flags
rates above a limit instead of printing fractions over 100%, and fits entries to the model."""
import json
import subprocess


def test_bench_medians_spreads_flags_and_fitted_prompts(make_model, r3_bin, tmp_path):
    model = make_model("olmoe")  # tiny: 4096 positions, weights that fit in cache
    out = tmp_path / "bench.json"
    run = subprocess.run([r3_bin, "bench", "--model", model, "--suite", "decode_b1,prefill_2k", "--reps", "2",
                          "--decode-tokens", "4", "--prefill-tokens", "9000", "--json", str(out)],
                         capture_output=True, text=True, check=True)
    assert "prefill_2k runs 4094-token prompts, not 9000 (the model allows 4096 positions" in run.stderr
    assert "limits over 3 measurements" in run.stdout  # before the suite and after each entry
    rows = {r["name"]: r for r in json.loads(out.read_text())}
    assert rows["prefill_2k"]["prompt_len"] == 4094
    for r in rows.values():
        s = r["tokens_per_s_routes_off_spread"]
        assert s["min"] <= s["median"] <= s["max"]
        assert r["tokens_per_s_routes_off"] == s["median"]
        m = r["machine_read_gb_per_s"]
        assert m["min"] <= m["median"] <= m["max"]
    d = rows["decode_b1"]
    assert d["weight_bandwidth_fraction"] <= 1.0
    # A tiny model's weights sit in cache: a rate over the read bandwidth is flagged, not a fraction.
    if d["weight_bandwidth_over_read"]:
        line = next(l for l in run.stdout.splitlines() if l.startswith("decode_b1"))
        assert "> limit" in line


def test_batch_sizes_name_the_decode_entries(make_model, r3_bin, tmp_path):
    """--batch-sizes 1,8,3 runs decode_b1, decode_b8 and decode_b3 (that many requests decoding
    together) in that order, in place of the suite's decode entries; a bad list is an error."""
    model = make_model("olmoe")
    out = tmp_path / "bench.json"
    subprocess.run([r3_bin, "bench", "--model", model, "--suite", "decode_b32,prefill_2k", "--batch-sizes", "1,8,3",
                    "--reps", "1", "--decode-tokens", "2", "--prefill-tokens", "64", "--json", str(out)],
                   capture_output=True, text=True, check=True)
    rows = json.loads(out.read_text())
    assert [r["name"] for r in rows] == ["decode_b1", "decode_b8", "decode_b3", "prefill_2k"]
    assert [r["requests"] for r in rows[:3]] == [1, 8, 3]
    bad = subprocess.run([r3_bin, "bench", "--model", model, "--batch-sizes", "8,x"], capture_output=True, text=True)
    assert bad.returncode != 0 and "--batch-sizes takes batch sizes" in bad.stderr


def test_speculative_entries_set_speculation_against_none(make_model, r3_bin, tmp_path):
    """decode_b1_spec and decode_b8_spec run one workload (prompts the output can copy) without
    and with NGRAM speculation in one run, and report both rates, the speed-up and the drafts'
    acceptance; above --speculative-disable-by-batch-size requests decoding, no step drafts."""
    model = make_model("olmoe")
    out = tmp_path / "bench.json"
    run = subprocess.run([r3_bin, "bench", "--model", model, "--suite", "decode_b1_spec,decode_b8_spec", "--reps", "1",
                          "--decode-tokens", "32", "--speculative-disable-by-batch-size", "4", "--json", str(out)],
                         capture_output=True, text=True, check=True)
    rows = {r["name"]: r for r in json.loads(out.read_text())}
    b1, b8 = rows["decode_b1_spec"], rows["decode_b8_spec"]
    for r in (b1, b8):
        assert r["tokens_per_s_speculation_off"] > 0 and r["tokens_per_s_speculation_on"] > 0
        assert r["speedup"] == r["tokens_per_s_speculation_on"] / r["tokens_per_s_speculation_off"]
        assert 0 <= r["acceptance_rate"] <= 1
    assert b1["draft_tokens"] > 0 and b1["steps_drafting_off"] == 0
    assert b8["draft_tokens"] == 0 and b8["steps_drafting_off"] > 0  # 8 decoding > 4
    assert "decode_b1_spec   speculation off" in run.stdout
