"""r3.torch: the PyTorch modules load r3's checkpoints (and write them back), agree with the
engine on its own rollouts, and RouterReplay forces routes: a recorded forward replays bit for bit
in fp32, forced ids are used exactly, gradients reach the router through the recomputed gate
weights, and -1 rows fall back to the live router."""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import r3  # noqa: E402
from r3.torch import MoEForCausalLM, RouterReplay, gate_weights, patch_moe_block  # noqa: E402
from r3.torch.checkpoint import load_state_dict  # noqa: E402
from r3.torch.replay import live_topk  # noqa: E402

ARCHS = ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "glm4_moe", "deepseek_v3", "deepseek_v3_yarn", "gpt_oss",
         "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "mixtral_defaults", "glm4_moe_defaults"]


def with_yarn(path, out):
    """A copy of a checkpoint with DeepSeek-V3's YaRN rope_scaling in its config."""
    import json
    import shutil
    shutil.copytree(path, out)
    cfg = json.load(open(os.path.join(out, "config.json")))
    cfg["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32,
                           "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"))
    return out


def without_defaulted_keys(path, out):
    """A copy of a checkpoint whose config leaves rope_theta and rms_norm_eps to the family's
    defaults (Mixtral: 1e6 and 1e-5, GLM-4.5: 1e-5), which r3.torch takes from r3's parse."""
    import json
    import shutil
    shutil.copytree(path, out)
    cfg = json.load(open(os.path.join(out, "config.json")))
    cfg.pop("rope_theta", None)
    cfg.pop("rms_norm_eps", None)
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"))
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_loads_writes_back_and_agrees_with_the_engine(make_model, tmp_path, arch):
    if arch == "deepseek_v3_yarn":
        path = with_yarn(make_model("deepseek_v3"), str(tmp_path / "yarn"))
    elif arch.endswith("_defaults"):
        path = without_defaulted_keys(make_model(arch[:-len("_defaults")]), str(tmp_path / "defaults"))
    else:
        path = make_model(arch)
    model = MoEForCausalLM.from_pretrained(path)
    # Written back: the same tensors by the same names (bf16 in, bf16 out: the same bits).
    model.save_pretrained(str(tmp_path / "out"))
    a, b = load_state_dict(path), load_state_dict(str(tmp_path / "out"))
    assert set(a) == set(b)
    for n in a:
        assert torch.equal(a[n], b[n]), n
    # The engine's rollout, scored by the torch model: logprobs close, routes mostly the same, and
    # replaying the engine's routes makes them all the same.
    llm = r3.LLM(path, enable_return_routed_experts=True, threads=1, num_kv_blocks=64)
    prompt = [3 + (i * 37) % 400 for i in range(12)]
    (out,) = llm.generate([{"prompt_token_ids": prompt}], r3.SamplingParams(max_tokens=12, temperature=1.0, seed=5,
                                                                            ignore_eos=True,
                                                                            return_routed_expert_weights=True))
    o = out.outputs[0]
    ids = torch.tensor(prompt + o.token_ids)
    engine_routes = np.concatenate([o.routed_experts, np.full((1,) + o.routed_experts.shape[1:], -1)])
    with torch.no_grad():
        logits, own = model(ids)
        model.set_replay(engine_routes)
        logits_r, forced = model(ids)
        trainer_weights = torch.stack([b.last_gate_weights for b in model.moe_blocks()], 1).float().numpy()
        model.clear_replay()
    P = len(prompt)
    lp = torch.log_softmax(logits, -1)[P - 1:-1].gather(1, torch.tensor(o.token_ids)[:, None]).squeeze(1)
    lp_r = torch.log_softmax(logits_r, -1)[P - 1:-1].gather(1, torch.tensor(o.token_ids)[:, None]).squeeze(1)
    rows = o.routed_experts.shape[0]
    agree = (np.sort(own.numpy()[:rows], -1) == np.sort(o.routed_experts, -1)).all(-1).mean()
    assert agree > 0.9, agree
    assert (forced.numpy()[:rows] == o.routed_experts).all(), "replayed routes are the engine's, exactly"
    # The gate weights the engine returns (return_routed_expert_weights) are those the trainer
    # recomputes for the replayed experts, up to the engine's bf16 activations.
    w = o.routed_expert_weights
    assert w.dtype == np.float32 and w.shape == o.routed_experts.shape
    hybrid = arch.startswith("qwen3_next") or arch.startswith("qwen3_5")
    wbound = (0.08 if hybrid else 0.03) * model.config.router.get("scaling", 1.0)  # as EngineVsReference
    assert np.abs(w - trainer_weights[:rows]).max() < wbound, np.abs(w - trainer_weights[:rows]).max()
    # The engine rounds a DeltaNet block's input and output to bf16, which moves logprobs more than
    # attention's rounding does (docs/ARCHITECTURE.md, "Gated DeltaNet hybrids": 0.08 there too).
    bound = 0.08 if arch.startswith("qwen3_next") or arch.startswith("qwen3_5") else 0.05
    assert (lp_r - torch.tensor(o.logprobs)).abs().max() < bound
    assert (lp_r - torch.tensor(o.logprobs)).abs().mean() <= (lp - torch.tensor(o.logprobs)).abs().mean() + 1e-3


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe", "deepseek_v3", "gpt_oss", "qwen3_next", "qwen3_5_moe"])
def test_replay_of_a_recorded_forward_is_bit_identical_and_forced_ids_are_used(make_model, arch):
    model = MoEForCausalLM.from_pretrained(make_model(arch))
    ids = torch.tensor([5, 9, 33, 7, 120, 64, 3, 18])
    blocks = model.moe_blocks()
    with torch.no_grad():
        RouterReplay.set_global_action(RouterReplay.RECORD, [b.replay for b in blocks])
        logits, routes = model(ids)
        recorded = torch.stack([b.replay.get_recorded_indices()[0] for b in blocks], dim=1)
        assert torch.equal(recorded, routes)
        model.set_replay(recorded)
        logits2, routes2 = model(ids)
        assert torch.equal(logits, logits2), "the replayed forward is the recorded one, bit for bit"
        # REPLAY_BACKWARD forces the same ids again (activation recomputation).
        RouterReplay.set_global_action(RouterReplay.REPLAY_BACKWARD, [b.replay for b in blocks])
        logits3, _ = model(ids)
        assert torch.equal(logits, logits3)
        # Arbitrary forced sets are used exactly; -1 rows take the live router's.
        E, K = model.config.num_experts, model.config.top_k
        g = torch.Generator().manual_seed(0)
        forced = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(ids.shape[0] * len(blocks))])
        forced = forced.view(ids.shape[0], len(blocks), K)
        forced[2] = -1
        model.set_replay(forced)
        _, used = model(ids)
        model.clear_replay()
    keep = torch.ones(ids.shape[0], dtype=torch.bool)
    keep[2] = False
    assert torch.equal(used[keep], forced[keep])
    # Row 2 (-1) is routed live: at the first MoE layer its input does not depend on the forced
    # rows yet, so the live choice is the recorded one there.
    assert torch.equal(used[2, 0], routes[2, 0])


def test_the_hybrids_vision_language_release_and_text_class_are_one_decoder(make_model, tmp_path):
    """Qwen3.5-MoE's VL release (text_config, model.language_model., fused experts, a vision tower
    and MTP weights) and its text class (model., per-expert tensors) hold the same weights for one
    seed: the same logits bit for bit; what r3 does not run is kept and written back as loaded."""
    vl = MoEForCausalLM.from_pretrained(make_model("qwen3_5_moe"))
    text = MoEForCausalLM.from_pretrained(make_model("qwen3_5_moe_text"))
    assert vl.config.fused_experts and not text.config.fused_experts
    assert any(n.startswith("model.visual.") for n in vl.passthrough)
    assert any(n.startswith("mtp.") for n in vl.passthrough) and any(n.startswith("mtp.") for n in text.passthrough)
    ids = torch.tensor([5, 9, 33, 7, 120, 64, 3, 18, 200, 11])
    with torch.no_grad():
        (la, ra), (lb, rb) = vl(ids), text(ids)
    assert torch.equal(la, lb) and torch.equal(ra, rb)
    # DeltaNet layers route too (every layer is MoE), the shared expert never appears in routes.
    assert ra.shape == (len(ids), vl.config.num_layers, vl.config.top_k)
    assert int(ra.max()) < vl.config.num_experts


def test_unsupported_configs_are_refused_by_name(make_model):
    from r3.torch import MoEConfig
    with pytest.raises(ValueError, match="linear"):
        MoEConfig({"architectures": ["DeepseekV3ForCausalLM"], "rope_scaling": {"type": "linear", "factor": 4},
                   "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1,
                   "num_experts_per_tok": 1})
    with pytest.raises(ValueError, match="FooForCausalLM"):
        MoEConfig({"architectures": ["FooForCausalLM"]})
    import json
    raw = json.load(open(os.path.join(make_model("qwen3_5_moe_text"), "config.json")))
    raw["rope_parameters"]["rope_type"] = "yarn"
    with pytest.raises(ValueError, match="rope_parameters.rope_type"):
        MoEConfig(raw)
    with pytest.raises(ValueError, match="text_config"):
        MoEConfig({"architectures": ["Qwen3_5MoeForConditionalGeneration"]})


def test_minus_one_rows_fall_back_to_the_live_router_and_gradients_reach_the_router():
    torch.manual_seed(0)
    E, K, H = 8, 2, 4
    for router in ({"kind": "softmax", "top_k": K, "renormalize": True},
                   {"kind": "softmax", "top_k": K, "renormalize": False},
                   {"kind": "sigmoid", "top_k": K, "renormalize": True, "scaling": 2.5},
                   {"kind": "topk_softmax", "top_k": K}):
        W = torch.randn(E, H, requires_grad=True)
        h = torch.randn(5, H)
        logits = h @ W.t()
        rr = RouterReplay()
        forced = torch.tensor([[0, 1], [2, 3], [-1, -1], [4, 5], [6, 7]])
        rr.set_target_indices(forced)
        rr.action = RouterReplay.REPLAY_FORWARD
        ids = rr.select(live_topk(logits, router))
        assert torch.equal(ids[2], live_topk(logits, router)[2])
        assert torch.equal(ids[[0, 1, 3, 4]], forced[[0, 1, 3, 4]])
        w = gate_weights(logits, ids, router)
        (w * torch.arange(1.0, K + 1)).sum().backward()
        assert W.grad is not None and W.grad.abs().sum() > 0, router
        # The weights are the live router's at the forced ids.
        if router["kind"] == "softmax" and not router["renormalize"]:
            assert torch.allclose(w, torch.softmax(logits, -1).gather(1, ids))
    with pytest.raises(RuntimeError, match="no target"):
        rr = RouterReplay()
        rr.action = RouterReplay.REPLAY_FORWARD
        rr.select(torch.zeros(1, 2, dtype=torch.long))


def test_patch_moe_block_puts_replay_on_a_users_own_block():
    torch.manual_seed(1)
    E, K, H = 6, 2, 4

    class UserMoE(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router = torch.nn.Linear(H, E, bias=False)
            self.experts = torch.nn.ModuleList(torch.nn.Linear(H, H) for _ in range(E))

    def experts(block, h, ids, w):
        out = torch.zeros_like(h)
        for t in range(h.shape[0]):
            for j in range(ids.shape[1]):
                out[t] += w[t, j] * block.experts[int(ids[t, j])](h[t])
        return out

    block = UserMoE()
    rr = patch_moe_block(block, lambda b, h: b.router(h), experts, {"kind": "softmax", "top_k": K, "renormalize": True})
    x = torch.randn(3, H)
    rr.set_target_indices(torch.tensor([[0, 1], [2, 3], [4, 5]]))
    rr.action = RouterReplay.REPLAY_FORWARD
    y = block(x)
    y.sum().backward()
    assert block.router.weight.grad.abs().sum() > 0
    assert block.experts[5].weight.grad is not None and block.experts[5].weight.grad.abs().sum() > 0


def expect_replay_reproduces_the_engine(model, served, prompt, seed):
    """The engine serving `served` samples a rollout with routes; the torch model replaying them
    gives its logprobs (within bf16 against fp32) and uses exactly its experts."""
    llm = r3.LLM(served, enable_return_routed_experts=True, threads=1, num_kv_blocks=64)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], r3.SamplingParams(max_tokens=8, temperature=1.0, seed=seed,
                                                                            ignore_eos=True))
    o = out.outputs[0]
    routes = np.concatenate([o.routed_experts, np.full((1,) + o.routed_experts.shape[1:], -1)])
    with torch.no_grad():
        model.set_replay(routes)
        logits, used = model(torch.tensor(prompt + o.token_ids))
        model.clear_replay()
    lp = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(1, torch.tensor(o.token_ids)[:, None]).squeeze(1)
    assert (lp - torch.tensor(o.logprobs)).abs().max() < 0.05
    assert (used.numpy()[:o.routed_experts.shape[0]] == o.routed_experts).all()


def test_gpt_oss_mxfp4_is_refused_and_its_dequantized_layout_loads(r3_bin, tmp_path):
    import subprocess
    for quant in ("mxfp4", "mxfp4-dequantized"):
        subprocess.run([r3_bin, "make-model", "--arch", "gpt_oss", "--quant", quant, "--out", str(tmp_path / quant)],
                       check=True, stdout=subprocess.DEVNULL)
    with pytest.raises(ValueError, match="dequantize"):
        MoEForCausalLM.from_pretrained(str(tmp_path / "mxfp4"))
    # The engine serves the MXFP4 checkpoint; the torch model of its dequantized weights agrees.
    expect_replay_reproduces_the_engine(MoEForCausalLM.from_pretrained(str(tmp_path / "mxfp4-dequantized")),
                                        str(tmp_path / "mxfp4"), [3 + (i * 53) % 400 for i in range(20)], seed=3)


def test_fp8_checkpoints_load_as_their_dequantized_layout(r3_bin, tmp_path):
    import subprocess
    for quant in ("fp8", "fp8-dequantized"):
        subprocess.run([r3_bin, "make-model", "--arch", "deepseek_v3", "--quant", quant, "--fp8-block", "32x48",
                        "--out", str(tmp_path / quant)], check=True, stdout=subprocess.DEVNULL)
    a, b = load_state_dict(str(tmp_path / "fp8")), load_state_dict(str(tmp_path / "fp8-dequantized"))
    assert set(a) == set(b)
    for n in a:
        assert torch.equal(a[n], b[n]), n
    # The engine serves the FP8 checkpoint; the torch model of the same file replays its routes.
    expect_replay_reproduces_the_engine(MoEForCausalLM.from_pretrained(str(tmp_path / "fp8")), str(tmp_path / "fp8"),
                                        [3 + (i * 29) % 400 for i in range(16)], seed=4)


def test_load_balancing_loss_is_one_when_balanced_larger_when_collapsed_and_reaches_the_router(make_model):
    """The warm-up's auxiliary loss: E * sum_e f_e * P_e per MoE layer, 1 for uniform probabilities
    with every expert chosen equally often, above 1 when routing piles onto a few experts, and
    its gradient reaches the router weights."""
    model = MoEForCausalLM.from_pretrained(make_model("qwen3_moe"))
    blocks = model.moe_blocks()
    E, K = blocks[0].c.num_experts, blocks[0].c.top_k
    T = E * 4
    for b in blocks:
        ids = torch.arange(T * K).reshape(T, K) % E
        b.last_router = (torch.zeros(T, E), ids)
    assert model.load_balancing_loss().item() == pytest.approx(1.0, abs=1e-6)
    skew = torch.zeros(T, E)
    skew[:, :K] = 5.0
    for b in blocks:
        b.last_router = (skew, torch.arange(K).repeat(T, 1))
    assert model.load_balancing_loss().item() > 2.0
    model.zero_grad()
    model(torch.tensor([[1, 5, 9, 4, 7, 3]]))
    model.load_balancing_loss().backward()
    assert all(b.gate.weight.grad is not None and b.gate.weight.grad.abs().sum() > 0 for b in blocks)


@pytest.mark.parametrize("arch", ["olmoe", "gpt_oss", "deepseek_v3", "qwen3_next"])
def test_a_layer_the_engine_reads_differently_is_refused_by_name(make_model, arch):
    """r3.torch checks every value it derives against r3's own description (_parse_model_config,
    the engine's visit_fields): one field of one layer read differently is refused naming it."""
    import copy
    import json
    from r3._r3 import _parse_model_config
    from r3.torch.model import MoEConfig
    cfg = MoEConfig.from_dir(make_model(arch))
    engine = _parse_model_config(json.dumps(cfg.raw))
    cfg._check_against(engine)  # as read: the same
    last = max(i for i, layer in enumerate(engine["layers"]) if layer["moe"])
    changed = copy.deepcopy(engine)
    changed["layers"][last]["intermediate"] += 1
    with pytest.raises(ValueError, match=f"layers.{last}.intermediate"):
        cfg._check_against(changed)
    changed = copy.deepcopy(engine)
    changed["router"]["n_group"] += 1
    with pytest.raises(ValueError, match="router.n_group"):
        cfg._check_against(changed)


def test_torch_serves_the_engines_families():
    """r3.torch's model classes are the engine's family registry (_r3._families), each with a
    torch forward."""
    from r3._r3 import _families
    from r3.torch import model
    assert model._ARCHS == _families()
    assert set(_families().values()) == set(model._TORCH_FAMILIES)
