"""python3 -m r3.rl: a GRPO-style RL loop on a small MoE that shows what router replay does.

1. Warm-up: a Qwen3-MoE-style model (written here in the Hugging Face layout) learns, by
   supervised training in PyTorch, to repeat a few digits (tokens) in any order, with the
   load-balancing loss MoE pretraining uses: its routers specialise while staying balanced (near
   ties between experts, as in trained MoEs), and its policy keeps the order open for RL.
2. RL, one arm per replay setting from the same warm-up checkpoint and seed: each step r3 samples
   G completions for each of B prompts with routes (bf16 weights, as served); the reward is the
   fraction of positions that hold the sorted digits; advantages are normalised within each group; the PyTorch
   trainer (fp32 weights, a bf16 mixed-precision forward by default) scores the sampled tokens with the engine's routes replayed (--replay on) or its
   own routing (off), takes a PPO-clipped policy step against the engine's logprobs, and sends the
   new weights to the engine in memory (update_weights_from_tensors).
Per step: reward, train/inference k3 KL and extreme-token fraction on the sampled tokens (trainer
logprobs before the update vs the engine's), router disagreement (engine routes vs the routes the
trainer used), gradient norm, clip fraction. --replay both runs both arms and writes JSON and an
SVG of the metrics over steps.
"""
import argparse
import json
import math
import os
import random
import sys
import time

import numpy as np

import r3

try:
    import torch
    from r3.torch import MoEConfig, MoEForCausalLM
except ImportError as e:  # pragma: no cover
    raise SystemExit(f"r3.rl needs PyTorch (Debian: apt-get install python3-torch): {e}")

PAD, BOS, EOS, SEP, DIGIT0 = 0, 1, 2, 3, 10


def model_config(args):
    """A Qwen3-MoE config r3's engine and r3.torch both read."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 64,
        "hidden_size": args.hidden, "num_hidden_layers": args.layers, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": args.hidden // 4, "num_experts": args.experts,
        "num_experts_per_tok": args.top_k, "moe_intermediate_size": args.hidden // 2, "intermediate_size": args.hidden * 2,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu",
        "bos_token_id": BOS, "eos_token_id": EOS, "torch_dtype": "bfloat16",
    }


def task(rng, n, shuffled=False):
    """Prompt [BOS, digits..., SEP]; target: the digits sorted (or, for the warm-up, in a random
    order: the model learns to repeat the digits with the order left open, so its policy keeps
    entropy for RL to shape into sorting)."""
    digits = [rng.randrange(10) for _ in range(n)]
    out = sorted(digits) if not shuffled else rng.sample(digits, len(digits))
    return [BOS] + [DIGIT0 + d for d in digits] + [SEP], [DIGIT0 + d for d in out] + [EOS]


def reward(target, completion):
    return sum(1.0 for a, b in zip(target, completion) if a == b) / len(target)


def init_weights(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / math.sqrt(p.shape[-1])))


def warm_up(model, args, log):
    """Supervised sorting until the routers are sharp (and the task mostly solved)."""
    rng = random.Random(args.seed)
    opt = torch.optim.Adam(model.parameters(), lr=args.warmup_lr)
    for step in range(args.warmup_steps):
        batch = [task(rng, args.digits, shuffled=True) for _ in range(args.warmup_batch)]
        ids = torch.tensor([p + t for p, t in batch])
        logits, _ = model(ids[:, :-1])
        P = len(batch[0][0])
        loss = torch.nn.functional.cross_entropy(logits[:, P - 1:].reshape(-1, logits.shape[-1]), ids[:, P:].reshape(-1))
        if args.aux_loss_coef:
            loss = loss + args.aux_loss_coef * model.load_balancing_loss()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == args.warmup_steps - 1:
            acc = (logits[:, P - 1:].argmax(-1) == ids[:, P:]).float().mean().item()
            log(f"warm-up step {step:4d}  loss {loss.item():.4f}  token accuracy {acc:.3f} (of a random order)")


def to_engine(model):
    """The weights as the engine stores them: bf16 bits (int16 arrays), fp32 where the checkpoint has fp32."""
    dtypes = model.checkpoint_dtypes()
    out = {}
    for n, t in model.hf_state_dict().items():
        t = t.detach().to(dtypes[n]).contiguous()
        out[n] = t.view(torch.int16).numpy() if dtypes[n] is torch.bfloat16 else t.numpy()
    return out


def run_arm(replay, base_dir, args, log):
    torch.manual_seed(args.seed)
    model = MoEForCausalLM.from_pretrained(base_dir)
    llm = r3.LLM(base_dir, enable_return_routed_experts=True, threads=args.threads, num_kv_blocks=512,
                 max_num_seqs=64, max_num_batched_tokens=1024)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    rng = random.Random(args.seed + 1)
    rows = []
    L, K = model.config.num_layers, model.config.top_k
    for step in range(args.steps):
        t0 = time.time()
        prompts = [task(rng, args.digits) for _ in range(args.prompts)]
        requests = [{"prompt_token_ids": p} for p, _ in prompts]
        outs = llm.generate(requests, r3.SamplingParams(max_tokens=args.digits + 1, temperature=1.0, n=args.group,
                                                        seed=args.seed * 1000 + step, stop_token_ids=[EOS]))
        seqs = []
        for (prompt, target), out in zip(prompts, outs):
            rs = [reward(target, c.token_ids) for c in out.outputs]
            mean, std = float(np.mean(rs)), float(np.std(rs))
            for c, r in zip(out.outputs, rs):
                seqs.append((prompt, c, r, (r - mean) / (std + 1e-6)))
        # One padded batch: prompt + completion, completions padded with EOS (masked out).
        P, C = len(prompts[0][0]), args.digits + 1
        ids = torch.full((len(seqs), P + C), EOS, dtype=torch.long)
        mask = torch.zeros(len(seqs), C)
        eng_lp = torch.zeros(len(seqs), C)
        eng_routes = np.full((len(seqs), P + C, L, K), -1, dtype=np.int64)
        adv = torch.tensor([a for _, _, _, a in seqs])
        for i, (prompt, c, _, _) in enumerate(seqs):
            n = len(c.token_ids)
            ids[i, :P] = torch.tensor(prompt)
            ids[i, P:P + n] = torch.tensor(c.token_ids)
            mask[i, :n] = 1
            eng_lp[i, :n] = torch.tensor(c.logprobs)
            eng_routes[i, :c.routed_experts.shape[0]] = c.routed_experts
        if replay:
            model.set_replay(eng_routes)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.trainer_dtype == "bf16"):
            logits, used = model(ids)
        logits = logits.float()
        model.clear_replay()
        lp = torch.log_softmax(logits[:, P - 1:P + C - 1], -1).gather(2, ids[:, P:, None]).squeeze(2)
        ratio = torch.exp(lp - eng_lp)
        clipped = torch.clamp(ratio, 1 - args.clip, 1 + args.clip)
        loss = -(torch.minimum(ratio * adv[:, None], clipped * adv[:, None]) * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm))
        opt.step()
        llm.update_weights_from_tensors(to_engine(model))
        # Metrics on the sampled tokens (trainer logprobs before this step's update).
        m = mask.bool()
        d = (lp.detach() - eng_lp)[m].numpy()
        r_ = np.exp(d)
        # Router disagreement over the positions the engine routed (prompt + sampled but the last).
        used_np = used.numpy()
        pairs = differing = 0
        for i, (_, c, _, _) in enumerate(seqs):
            n = c.routed_experts.shape[0]
            a = np.sort(eng_routes[i, :n], -1)
            b = np.sort(used_np[i, :n], -1)
            differing += int((a != b).any(-1).sum())
            pairs += n * L
        row = {"step": step, "replay": replay, "reward": float(np.mean([r for _, _, r, _ in seqs])),
               "k3_kl": float(np.mean(r_ - 1 - d)), "extreme_token_fraction": float(np.mean(np.maximum(r_, 1 / r_) > 2.0)),
               "mean_abs_dlogprob": float(np.mean(np.abs(d))), "router_disagreement_pairs": differing / pairs,
               "grad_norm": grad_norm, "clip_fraction": float(((ratio.detach() - 1).abs() > args.clip)[m].float().mean()),
               "seconds": time.time() - t0}
        rows.append(row)
        log(f"replay {'on ' if replay else 'off'} step {step:3d}  reward {row['reward']:.3f}  k3 {row['k3_kl']:.2e}  "
            f"router pairs differing {row['router_disagreement_pairs']:.4f}  |dlp| {row['mean_abs_dlogprob']:.2e}  "
            f"grad {grad_norm:.3f}  clip {row['clip_fraction']:.3f}")
    return rows


def svg_plot(arms, path):
    """Three panels over steps (reward, k3 KL, router disagreement), both arms, plain SVG."""
    panels = [("reward", "reward"), ("k3_kl", "train/inference k3 KL"), ("router_disagreement_pairs", "router pairs differing")]
    W, H, pad = 300, 200, 40
    colors = {"on": "#1f77b4", "off": "#d62728"}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{3 * W}" height="{H + 30}" font-family="sans-serif" font-size="11">']
    for pi, (key, title) in enumerate(panels):
        x0 = pi * W
        vals = [r[key] for rows in arms.values() for r in rows]
        lo, hi = min(vals + [0.0]), max(vals + [1e-12])
        out.append(f'<text x="{x0 + W / 2}" y="14" text-anchor="middle">{title}</text>')
        out.append(f'<rect x="{x0 + pad}" y="20" width="{W - pad - 10}" height="{H - 40}" fill="none" stroke="#999"/>')
        out.append(f'<text x="{x0 + pad - 3}" y="24" text-anchor="end">{hi:.3g}</text>')
        out.append(f'<text x="{x0 + pad - 3}" y="{H - 20}" text-anchor="end">{lo:.3g}</text>')
        for name, rows in arms.items():
            if not rows:
                continue
            n = max(1, len(rows) - 1)
            pts = " ".join(f"{x0 + pad + (W - pad - 10) * i / n:.1f},{20 + (H - 40) * (1 - (r[key] - lo) / (hi - lo)):.1f}"
                           for i, r in enumerate(rows))
            out.append(f'<polyline fill="none" stroke="{colors[name]}" stroke-width="1.5" points="{pts}"/>')
        out.append(f'<text x="{x0 + W / 2}" y="{H - 5}" text-anchor="middle">step</text>')
    out.append(f'<text x="10" y="{H + 25}" fill="{colors["on"]}">replay on</text>')
    out.append(f'<text x="90" y="{H + 25}" fill="{colors["off"]}">replay off</text>')
    out.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(out))


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m r3.rl", description=__doc__.split("\n")[0])
    ap.add_argument("--replay", choices=["on", "off", "both"], default="both")
    ap.add_argument("--steps", type=int, default=20, help="RL steps per arm")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt (GRPO group)")
    ap.add_argument("--digits", type=int, default=6)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--warmup-batch", type=int, default=64)
    ap.add_argument("--warmup-lr", type=float, default=3e-3)
    ap.add_argument("--aux-loss-coef", type=float, default=0.01,
                    help="weight of the load-balancing loss in the warm-up (as MoE pretraining adds it; 0: none)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--trainer-dtype", choices=["fp32", "bf16"], default="bf16",
                    help="the RL trainer's forward: bf16 autocast (mixed precision, as Megatron and FSDP train) or fp32")
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=0, help="engine and torch threads (0: all cores)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="out/rl", help="directory for rl.json, rl.svg and the checkpoints")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    log = lambda s: print(s, flush=True)  # noqa: E731
    t0 = time.time()
    torch.manual_seed(args.seed)
    cfg = MoEConfig(model_config(args))
    model = MoEForCausalLM(cfg)
    init_weights(model, args.seed)
    warm_up(model, args, log)
    base = os.path.join(args.out, "warm")
    model.save_pretrained(base)
    log(f"warm-up done in {time.time() - t0:.0f} s; checkpoint {base}")
    arms = {}
    for name in (["on", "off"] if args.replay == "both" else [args.replay]):
        arms[name] = run_arm(name == "on", base, args, log)
    result = {"args": vars(args), "arms": arms, "seconds": time.time() - t0}
    with open(os.path.join(args.out, "rl.json"), "w") as f:
        json.dump(result, f, indent=1)
    svg_plot(arms, os.path.join(args.out, "rl.svg"))
    log(f"wrote {args.out}/rl.json and {args.out}/rl.svg in {time.time() - t0:.0f} s")
    if len(arms) == 2:
        on, off = arms["on"], arms["off"]
        log("step  reward(on/off)   k3 KL(on/off)          router pairs differing(on/off)")
        for a, b in zip(on, off):
            log(f"{a['step']:4d}  {a['reward']:.3f}/{b['reward']:.3f}   {a['k3_kl']:.2e}/{b['k3_kl']:.2e}   "
                f"{a['router_disagreement_pairs']:.4f}/{b['router_disagreement_pairs']:.4f}")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
