"""python3 -m r3.rl on a very small configuration: the loop runs end to end (warm-up, RL steps
with in-memory weight sync, both arms), writes its JSON and SVG, and with replay the trainer's
routes are exactly the engine's at every step."""
import json
import os

import pytest

pytest.importorskip("torch")

from r3 import rl  # noqa: E402


def test_rl_loop_both_arms_small(tmp_path):
    out = str(tmp_path / "rl")
    result = rl.main(["--steps", "2", "--warmup-steps", "20", "--warmup-batch", "16", "--layers", "2", "--hidden", "32",
                      "--experts", "8", "--top-k", "2", "--prompts", "2", "--group", "4", "--digits", "3",
                      "--threads", "1", "--out", out])
    assert os.path.exists(os.path.join(out, "rl.svg"))
    saved = json.load(open(os.path.join(out, "rl.json")))
    assert set(saved["arms"]) == {"on", "off"}
    for arm in ("on", "off"):
        assert len(result["arms"][arm]) == 2
        for row in result["arms"][arm]:
            for key in ("reward", "k3_kl", "extreme_token_fraction", "router_disagreement_pairs", "grad_norm",
                        "clip_fraction"):
                assert key in row
    assert all(r["router_disagreement_pairs"] == 0.0 for r in result["arms"]["on"])
    # Both arms start from the same checkpoint and sample with the same seeds.
    assert result["arms"]["on"][0]["reward"] == result["arms"]["off"][0]["reward"]
