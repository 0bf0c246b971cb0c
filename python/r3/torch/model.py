"""r3's MoE architectures as PyTorch modules (Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE, GLM-4.5,
DeepSeek-V3 with multi-head latent attention, GPT-OSS in its dequantized layout with sinks and
sliding windows, the Gated DeltaNet hybrids Qwen3-Next and Qwen3.5-MoE): the module tree mirrors
the Hugging Face tensor names, so a checkpoint loads by name and writes back the same (tensors
r3 does not run, MTP layers and a vision tower, are kept as loaded and written back). Token ids [T] or [B, T], fp32 by
default; every MoE layer carries a RouterReplay, and forward returns the routes it used.
RoPE scaling: YaRN, as r3's C++ config parser and transformers compute it; other types are
refused by name, as are DeepSeek-V3 attention biases.
"""
import json
import math
import os

import torch
from torch import nn

from .checkpoint import load_state_dict, save_state_dict
from .deltanet import GatedDeltaNet
from .._r3 import _families
from .replay import RouterReplay, gate_weights, live_topk

# {HF model class: family}: r3's family registry (model/families.h), so r3.torch builds exactly
# the families the engine serves; a family without a torch branch below is refused by name.
_ARCHS = _families()
_TORCH_FAMILIES = ("mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "glm4_moe", "deepseek_v3", "gpt_oss",
                   "qwen3_next", "qwen3_5_moe")
_HYBRIDS = ("qwen3_next", "qwen3_5_moe")


class MoEConfig:
    """The parts of config.json the forward reads, per family as r3's C++ parser reads them."""

    def __init__(self, raw):
        archs = raw.get("architectures") or []
        if not archs or archs[0] not in _ARCHS:
            raise ValueError(f"r3.torch: architecture {archs[:1]} is not supported (supported: {', '.join(_ARCHS)})")
        self.raw = raw
        self.arch = _ARCHS[archs[0]]
        if self.arch not in _TORCH_FAMILIES:
            raise ValueError(f"r3.torch: the {self.arch} family ({archs[0]}) has no torch forward yet")
        self.prefix = "model."  # of the decoder's tensors
        if archs[0] == "Qwen3_5MoeForConditionalGeneration":
            # The vision-language release: the decoder's config is text_config, its tensors live
            # under model.language_model. (the vision tower is not run), as r3's C++ parser reads it.
            if not isinstance(raw.get("text_config"), dict):
                raise ValueError(f"r3.torch: {archs[0]} needs a text_config object (the decoder's config)")
            text = dict(raw["text_config"])
            for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
                if key in raw and key not in text:
                    text[key] = raw[key]
            raw = text
            self.prefix = "model.language_model."
        self.vocab_size = raw["vocab_size"]
        self.hidden_size = raw["hidden_size"]
        self.num_layers = raw["num_hidden_layers"]
        self.num_heads = raw["num_attention_heads"]
        self.num_kv_heads = raw.get("num_key_value_heads", self.num_heads)
        self.head_dim = raw.get("head_dim", self.hidden_size // self.num_heads)
        self.rms_norm_eps = raw.get("rms_norm_eps", 1e-6)
        self.rope_theta = raw.get("rope_theta", 10000.0)
        self.top_k = raw["num_experts_per_tok"]
        self.tie_word_embeddings = raw.get("tie_word_embeddings", False)
        self.qkv_bias = (self.arch == "qwen2_moe" and raw.get("qkv_bias", True)) or \
            (self.arch == "glm4_moe" and raw.get("attention_bias", False))
        self.qk_norm = {"qwen3_moe": "per_head", "olmoe": "whole"}.get(self.arch)
        if self.arch == "glm4_moe" and raw.get("use_qk_norm", False):
            self.qk_norm = "per_head"
        self.rotary_dim = self.head_dim
        if self.arch == "glm4_moe":
            self.rotary_dim = int(self.head_dim * raw.get("partial_rotary_factor", 0.5))
        self.clip_qkv = raw.get("clip_qkv") if self.arch == "olmoe" else None
        self.shared_size = 0
        if self.arch == "mixtral":
            self.num_experts = raw["num_local_experts"]
            self.moe_intermediate = raw["intermediate_size"]
            self.renormalize = True
            self.moe_layers = list(range(self.num_layers))
        else:
            self.num_experts = raw.get("num_experts", 0)
            self.moe_intermediate = raw.get("moe_intermediate_size", raw.get("intermediate_size"))
            self.intermediate = raw.get("intermediate_size", 0)
            self.renormalize = raw.get("norm_topk_prob", False)
            if self.arch == "olmoe":
                self.moe_layers = list(range(self.num_layers))
            else:
                step = raw.get("decoder_sparse_step", 1)
                only = set(raw.get("mlp_only_layers") or [])
                self.moe_layers = [i for i in range(self.num_layers)
                                   if i not in only and self.num_experts > 0 and (i + 1) % step == 0]
            if self.arch == "qwen2_moe":
                self.shared_size = raw.get("shared_expert_intermediate_size", 0)
        self.mla = None
        self.num_mtp_layers = raw.get("num_nextn_predict_layers", 0) or 0
        self.yarn = parse_yarn(raw.get("rope_scaling"), raw.get("max_position_embeddings", 0))
        if self.arch == "deepseek_v3":
            if raw.get("attention_bias", False):
                raise ValueError("r3.torch: DeepSeek-V3 with attention_bias is not supported")
            self.mla = {"q_lora_rank": raw.get("q_lora_rank") or 0, "kv_lora_rank": raw["kv_lora_rank"],
                        "nope": raw["qk_nope_head_dim"], "rope": raw["qk_rope_head_dim"], "v": raw["v_head_dim"],
                        "interleave": raw.get("rope_interleave", True)}
            self.rotary_dim = self.mla["rope"]
            self.qkv_bias = False
        if self.arch in ("glm4_moe", "deepseek_v3"):
            # The DeepSeek-V3 router: sigmoid scores, a selection-only bias, group-limited choice.
            self.num_experts = raw.get("n_routed_experts", raw.get("num_experts"))
            self.moe_intermediate = raw["moe_intermediate_size"]
            self.intermediate = raw["intermediate_size"]
            self.renormalize = raw.get("norm_topk_prob", True)
            dense = raw.get("first_k_dense_replace", 0)
            self.moe_layers = list(range(dense, self.num_layers))
            self.shared_size = raw.get("n_shared_experts", 0) * self.moe_intermediate
            self.router = {"kind": "sigmoid", "top_k": self.top_k, "renormalize": self.renormalize,
                           "scaling": raw["routed_scaling_factor"], "n_group": raw["n_group"],
                           "topk_group": raw["topk_group"]}
        else:
            self.router = {"kind": "softmax", "top_k": self.top_k, "renormalize": self.renormalize}
        self.norm_offset = 0.0  # norms applied as (offset + w)
        self.output_gate = False
        self.linear_layers = [False] * self.num_layers  # Gated DeltaNet in place of attention
        self.deltanet = None
        self.fused_experts = False  # Qwen3.5's experts.gate_up_proj / down_proj (set by from_pretrained)
        if self.arch in _HYBRIDS:
            self._hybrid(raw)
        self.o_bias = self.sinks = False
        self.windows = [0] * self.num_layers
        if self.arch == "gpt_oss":
            # GptOssConfig: biased router (top-k of the logits, softmax over the k), fused biased
            # experts with the clamped SwiGLU, q/k/v/o biases, sinks, sliding and full layers.
            if raw.get("quantization_config"):
                raise ValueError("r3.torch: GPT-OSS with quantization_config (MXFP4) is not supported; load its "
                                 "dequantized layout (transformers' dequantize, or r3 make-model --quant mxfp4-dequantized)")
            self.num_experts = raw["num_local_experts"]
            self.moe_intermediate = raw["intermediate_size"]
            self.moe_layers = list(range(self.num_layers))
            self.qkv_bias = self.o_bias = raw.get("attention_bias", True)
            self.sinks = True
            types = raw.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                               for i in range(self.num_layers)]
            self.windows = [raw.get("sliding_window", 128) if t == "sliding_attention" else 0 for t in types]
            self.swiglu_limit = raw.get("swiglu_limit", 7.0)
            self.router = {"kind": "topk_softmax", "top_k": self.top_k}
        self._take_r3s_parse()

    def _take_r3s_parse(self):
        """The values r3's engine computes with, from its own C++ parse of the same config: the
        keys a config may leave out take the engine's defaults (Mixtral's rope_theta 1e6, Mixtral's
        and GLM-4.5's rms_norm_eps 1e-5), and the layout this parse derived must be the engine's."""
        from .._r3 import _parse_model_config
        engine = _parse_model_config(json.dumps(self.raw))
        self.rope_theta = engine["rope_theta"]
        self.rms_norm_eps = engine["rms_norm_eps"]
        for key, mine in (("num_layers", self.num_layers), ("num_experts", self.num_experts),
                          ("top_k", self.top_k), ("moe_layers", self.moe_layers)):
            if engine[key] != mine:
                raise ValueError(f"r3.torch: config.json gives {key} {mine!r} here but {engine[key]!r} to r3's engine")
        self._check_against(engine)

    def _check_against(self, engine):
        """Every value this parse derived that r3's description (_parse_model_config: the engine's
        visit_fields, nested) also holds must be the engine's, so the trainer never computes a
        layer the engine computes differently; a mismatch is refused naming the field."""
        def same(name, mine, theirs):
            if mine != theirs:
                raise ValueError(f"r3.torch: config.json gives {name} {mine!r} here but {theirs!r} to r3's engine")
        for key, mine in (("vocab_size", self.vocab_size), ("hidden_size", self.hidden_size),
                          ("num_heads", self.num_heads), ("num_kv_heads", self.num_kv_heads),
                          ("tie_word_embeddings", self.tie_word_embeddings)):
            same(key, mine, engine[key])
        if not self.mla:  # MLA's head sizes are its own (below)
            same("head_dim", self.head_dim, engine["head_dim"])
        router = engine["router"]
        if "renormalize" in self.router:  # GPT-OSS's top-k softmax has no renormalisation
            same("router.renormalize", bool(self.router["renormalize"]), router["renormalize"])
        same("router.routed_scaling_factor", float(self.router.get("scaling", 1.0)),
             router["routed_scaling_factor"])
        same("router.n_group", self.router.get("n_group", 1), router["n_group"])
        same("router.topk_group", self.router.get("topk_group", 1), router["topk_group"])
        same("zero_centred_norms", self.norm_offset == 1.0, engine["zero_centred_norms"])
        if self.mla:
            m = engine["mla"] or {}
            for mine, key in (("q_lora_rank", "q_lora_rank"), ("kv_lora_rank", "kv_lora_rank"),
                              ("nope", "qk_nope_head_dim"), ("rope", "qk_rope_head_dim"), ("v", "v_head_dim")):
                same(f"mla.{key}", self.mla[mine], m.get(key))
        if self.deltanet:
            d = engine["deltanet"] or {}
            for key in ("k_heads", "v_heads", "k_head_dim", "v_head_dim", "conv_kernel"):
                same(f"deltanet.{key}", self.deltanet[key], d.get(key))
            same("deltanet.combined_projections", self.deltanet["combined"], d.get("combined_projections"))
        qk_norm = {None: 0, "per_head": 1, "whole": 2}
        for i, layer in enumerate(engine["layers"]):
            a = layer["attention"]
            same(f"layers.{i}.attention.kind (Gated DeltaNet)", self.linear_layers[i], a["kind"] == 2)
            if self.linear_layers[i]:
                continue
            same(f"layers.{i}.attention.sliding_window", self.windows[i], a["sliding_window"])
            if not self.mla:
                same(f"layers.{i}.attention.rotary_dim", self.rotary_dim, a["rotary_dim"])
                same(f"layers.{i}.attention.qk_norm", qk_norm[self.qk_norm], a["qk_norm"])
                same(f"layers.{i}.attention.qkv_bias", bool(self.qkv_bias), a["qkv_bias"])
                same(f"layers.{i}.attention.o_bias", bool(self.o_bias), a["o_bias"])
                same(f"layers.{i}.attention.sinks", bool(self.sinks), a["sinks"])
                same(f"layers.{i}.attention.output_gate", bool(self.output_gate), a["output_gate"])
                same(f"layers.{i}.attention.clip_qkv", self.clip_qkv, a["clip_qkv"])
            if layer["moe"]:
                same(f"layers.{i}.intermediate", self.moe_intermediate, layer["intermediate"])
                same(f"layers.{i}.shared_intermediate", self.shared_size, layer["shared_intermediate"])

    def _hybrid(self, raw):
        """Qwen3NextConfig / Qwen3_5MoeTextConfig: zero-centred norms, gated full attention with
        per-head q/k norm and partial rotary every full_attention_interval-th layer (or as
        layer_types lists), Gated DeltaNet elsewhere, softmax top-k (Qwen3.5 always renormalises)
        beside one shared expert behind a sigmoid gate."""
        self.renormalize = self.arch == "qwen3_5_moe" or raw.get("norm_topk_prob", True)
        self.router = {"kind": "softmax", "top_k": self.top_k, "renormalize": self.renormalize}
        self.qk_norm = "per_head"
        self.output_gate = True
        self.norm_offset = 1.0
        self.shared_size = raw.get("shared_expert_intermediate_size", 0) or 0
        partial = raw.get("partial_rotary_factor", 0.25)
        for key, value in (raw.get("rope_parameters") or {}).items():
            if key in ("rope_type", "type"):
                if value != "default":
                    raise ValueError(f"r3.torch: rope_parameters.{key} {value!r} is not supported (default)")
            elif key == "rope_theta":
                self.rope_theta = value
            elif key == "partial_rotary_factor":
                partial = value
            elif key not in ("mrope_section", "mrope_interleaved"):  # text positions: plain RoPE
                raise ValueError(f"r3.torch: rope_parameters key {key!r} is not supported")
        self.rotary_dim = int(self.head_dim * partial)
        types = raw.get("layer_types")
        interval = raw.get("full_attention_interval", 4)
        self.linear_layers = [t == "linear_attention" for t in types] if types else \
            [(i + 1) % interval != 0 for i in range(self.num_layers)]
        self.deltanet = {"k_heads": raw["linear_num_key_heads"], "v_heads": raw["linear_num_value_heads"],
                         "k_head_dim": raw["linear_key_head_dim"], "v_head_dim": raw["linear_value_head_dim"],
                         "conv_kernel": raw.get("linear_conv_kernel_dim", 4), "combined": self.arch == "qwen3_next"}

    @classmethod
    def from_dir(cls, model_dir):
        with open(os.path.join(model_dir, "config.json")) as f:
            return cls(json.load(f))


def parse_yarn(rs, max_position_embeddings):
    """rope_scaling -> None or YaRN's parameters (transformers' _compute_yarn_parameters, and the
    MLA softmax mscale of DeepseekV3Attention), as r3's C++ parser reads them."""
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind != "yarn":
        raise ValueError(f"r3.torch: rope_scaling {kind!r} is not supported (only yarn)")
    known = {"rope_type", "type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "attention_factor", "truncate"}
    extra = set(rs) - known
    if extra:
        raise ValueError(f"r3.torch: rope_scaling key {sorted(extra)[0]!r} is not supported")

    def mscale_of(scale, m):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = float(rs["factor"])
    y = {"factor": factor, "original": int(rs.get("original_max_position_embeddings") or max_position_embeddings),
         "beta_fast": float(rs.get("beta_fast") or 32.0), "beta_slow": float(rs.get("beta_slow") or 1.0),
         "truncate": bool(rs.get("truncate", True))}
    m, m_all = float(rs.get("mscale") or 0), float(rs.get("mscale_all_dim") or 0)
    if rs.get("attention_factor") is not None:
        y["attention_factor"] = float(rs["attention_factor"])
    elif m and m_all:
        y["attention_factor"] = mscale_of(factor, m) / mscale_of(factor, m_all)
    else:
        y["attention_factor"] = mscale_of(factor, 1.0)
    y["softmax_mscale"] = mscale_of(factor, m_all) ** 2 if m_all else 1.0
    return y


def rope_inv_freq(dim, theta, yarn):
    half = dim // 2
    if not yarn:
        return [theta ** (-2.0 * i / dim) for i in range(half)]

    def correction_dim(rotations):
        return dim * math.log(yarn["original"] / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(yarn["beta_fast"]), correction_dim(yarn["beta_slow"])
    if yarn["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0.0), min(high, dim - 1.0)
    if low == high:
        high += 0.001
    out = []
    for i in range(half):
        pos = theta ** (2.0 * i / dim)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append((1.0 / (yarn["factor"] * pos)) * ramp + (1.0 / pos) * (1.0 - ramp))
    return out


def rms_norm(x, w, eps, offset=0.0):
    """x / rms(x) * (offset + w): offset 1 for zero-centred norms (Qwen3-Next, Qwen3.5)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)) * (w.float() + offset)


class RMSNorm(nn.Module):
    def __init__(self, n, eps, offset=0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps, self.offset = eps, offset

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps, self.offset)


def linear(i, o, bias=False):
    return nn.Linear(i, o, bias=bias)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); names as Qwen/OLMoE (gate_proj/up_proj/down_proj) or
    Mixtral's experts (w1/w3/w2)."""

    def __init__(self, hidden, inter, mixtral_names=False):
        super().__init__()
        self.names = ("w1", "w3", "w2") if mixtral_names else ("gate_proj", "up_proj", "down_proj")
        for n, (i, o) in zip(self.names, [(hidden, inter), (hidden, inter), (inter, hidden)]):
            setattr(self, n, linear(i, o))

    def forward(self, x):
        g, u, d = (getattr(self, n) for n in self.names)
        return d(nn.functional.silu(g(x)) * u(x))


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        qd, kvd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        # With an output gate (Qwen3-Next, Qwen3.5) q_proj gives each head [query, gate].
        self.q_proj = linear(c.hidden_size, 2 * qd if c.output_gate else qd, c.qkv_bias)
        self.k_proj = linear(c.hidden_size, kvd, c.qkv_bias)
        self.v_proj = linear(c.hidden_size, kvd, c.qkv_bias)
        self.o_proj = linear(qd, c.hidden_size, c.o_bias)
        if c.sinks:
            self.sinks = nn.Parameter(torch.zeros(c.num_heads))
        self.window = 0  # set per layer (DecoderLayer)
        if c.qk_norm == "per_head":
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, c.norm_offset)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, c.norm_offset)
        elif c.qk_norm == "whole":
            self.q_norm, self.k_norm = RMSNorm(qd, c.rms_norm_eps), RMSNorm(kvd, c.rms_norm_eps)

    def forward(self, x, cos, sin):
        """x [B, T, H] -> [B, T, H], causal within each sequence."""
        c, B, T = self.c, x.shape[0], x.shape[1]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        gate = None
        if c.output_gate:
            q, gate = torch.chunk(q.view(B, T, c.num_heads, 2 * c.head_dim), 2, dim=-1)
            q, gate = q.reshape(B, T, -1), gate.reshape(B, T, -1)
        if c.clip_qkv is not None:
            q, k, v = (t.clamp(-c.clip_qkv, c.clip_qkv) for t in (q, k, v))
        if c.qk_norm == "whole":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, c.num_heads, c.head_dim)
        k = k.view(B, T, c.num_kv_heads, c.head_dim)
        v = v.view(B, T, c.num_kv_heads, c.head_dim)
        if c.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, cos, sin, c.rotary_dim), rope(k, cos, sin, c.rotary_dim)
        rep = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(c.head_dim)
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        if self.window:  # keys j > t - window only
            mask = mask | torch.ones(T, T, dtype=torch.bool, device=x.device).tril(-self.window)
        scores = scores.masked_fill(mask, float("-inf"))
        if c.sinks:  # one more logit per head in every softmax, dropped after it (GptOssAttention)
            sink = self.sinks.float().view(1, -1, 1, 1).expand(B, -1, T, 1)
            p = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            p = torch.softmax(scores, dim=-1)
        out = torch.einsum("bhts,bshd->bthd", p, v).reshape(B, T, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)


class MlaAttention(nn.Module):
    """DeepSeek-V3's multi-head latent attention in its Hugging Face form: q (optionally through a
    low-rank q_a/q_b), a shared compressed KV (kv_a -> norm -> kv_b) plus one rotary key part for
    all heads; RoPE on interleaved pairs when rope_interleave."""

    def __init__(self, c):
        super().__init__()
        self.c, m = c, c.mla
        qk = m["nope"] + m["rope"]
        if m["q_lora_rank"]:
            self.q_a_proj = linear(c.hidden_size, m["q_lora_rank"])
            self.q_a_layernorm = RMSNorm(m["q_lora_rank"], 1e-6)
            self.q_b_proj = linear(m["q_lora_rank"], c.num_heads * qk)
        else:
            self.q_proj = linear(c.hidden_size, c.num_heads * qk)
        self.kv_a_proj_with_mqa = linear(c.hidden_size, m["kv_lora_rank"] + m["rope"])
        self.kv_a_layernorm = RMSNorm(m["kv_lora_rank"], 1e-6)
        self.kv_b_proj = linear(m["kv_lora_rank"], c.num_heads * (m["nope"] + m["v"]))
        self.o_proj = linear(c.num_heads * m["v"], c.hidden_size)

    def forward(self, x, cos, sin):
        c, m = self.c, self.c.mla
        B, T, nh = x.shape[0], x.shape[1], c.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if m["q_lora_rank"] else self.q_proj(x)
        q = q.view(B, T, nh, m["nope"] + m["rope"])
        q_nope, q_pe = q[..., :m["nope"]], q[..., m["nope"]:]
        ckv = self.kv_a_proj_with_mqa(x)
        latent, k_pe = ckv[..., :m["kv_lora_rank"]], ckv[..., m["kv_lora_rank"]:].reshape(B, T, 1, m["rope"])
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, T, nh, m["nope"] + m["v"])
        k_nope, v = kv[..., :m["nope"]], kv[..., m["nope"]:]
        if m["interleave"]:  # pairs (0,1),(2,3).. -> halves, as Hugging Face's interleaved rotation
            q_pe, k_pe = (t.reshape(*t.shape[:-1], -1, 2).transpose(-1, -2).reshape(t.shape) for t in (q_pe, k_pe))
        q_pe, k_pe = rope(q_pe, cos, sin, m["rope"]), rope(k_pe, cos, sin, m["rope"])
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(B, T, nh, m["rope"])], dim=-1)
        mscale = c.yarn["softmax_mscale"] if c.yarn else 1.0
        scores = torch.einsum("bthd,bshd->bhts", q, k) * (mscale / math.sqrt(m["nope"] + m["rope"]))
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
        p = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        return self.o_proj(torch.einsum("bhts,bshd->bthd", p, v).reshape(B, T, -1))


def rope_tables(T, dim, theta, device, yarn=None):
    inv = torch.tensor(rope_inv_freq(dim, theta, yarn), dtype=torch.float64, device=device)
    ang = torch.arange(T, dtype=torch.float64, device=device)[:, None] * inv[None, :]
    a = yarn["attention_factor"] if yarn else 1.0
    return (torch.cos(ang) * a).float(), (torch.sin(ang) * a).float()


def rope(x, cos, sin, rotary_dim):
    """NeoX-style rotation of the halves of each head's first rotary_dim dims (the rest pass)."""
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    x1, x2 = rot[..., :half], rot[..., half:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], dim=-1)


class SparseMoE(nn.Module):
    """Router, experts (and Qwen2-MoE's gated shared expert) of one MoE layer, with its RouterReplay."""

    def __init__(self, c):
        super().__init__()
        self.c = c
        mixtral = c.arch == "mixtral"
        if c.arch == "gpt_oss":
            self.router = linear(c.hidden_size, c.num_experts, bias=True)
            self.experts = FusedExperts(c)
            self.replay = RouterReplay()
            return
        self.gate = linear(c.hidden_size, c.num_experts)
        if c.fused_experts:
            self.experts = GateUpExperts(c)
        else:
            self.experts = nn.ModuleList(MLP(c.hidden_size, c.moe_intermediate, mixtral) for _ in range(c.num_experts))
        if c.arch in ("glm4_moe", "deepseek_v3"):
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(c.num_experts), requires_grad=False)
            if c.shared_size:
                self.shared_experts = MLP(c.hidden_size, c.shared_size)
        elif c.shared_size:
            self.shared_expert = MLP(c.hidden_size, c.shared_size)
            self.shared_expert_gate = linear(c.hidden_size, 1)
        self.replay = RouterReplay()

    def router_spec(self):
        if self.c.arch in ("glm4_moe", "deepseek_v3"):
            return {**self.c.router, "bias": self.gate.e_score_correction_bias.float()}
        return self.c.router

    def forward(self, x):
        """x [B, T, H] -> ([B, T, H], ids [B*T, K]); tokens flattened in (batch, position) order."""
        h = x.reshape(-1, x.shape[-1])
        logits = self.router(h) if self.c.arch == "gpt_oss" else self.gate(h)
        router = self.router_spec()
        ids = self.replay.select(live_topk(logits, router))
        w = gate_weights(logits, ids, router)
        self.last_router = (logits, ids)  # [B*T, E], [B*T, K]: for a load-balancing loss
        self.last_gate_weights = w  # [B*T, K]: what the experts were combined with
        if self.c.arch == "gpt_oss":
            return self.experts(h, ids, w).view_as(x), ids
        if self.c.fused_experts:
            out = self.experts(h, ids, w)
            if self.c.shared_size:
                out = out + self.shared_expert(h) * torch.sigmoid(self.shared_expert_gate(h))
            return out.view_as(x), ids
        T, K = ids.shape
        contrib = h.new_zeros(T, K, h.shape[-1])
        for e in torch.unique(ids).tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            contrib[tok, slot] = self.experts[e](h[tok]) * w[tok, slot, None]
        out = contrib.sum(dim=1)
        if self.c.arch in ("glm4_moe", "deepseek_v3") and self.c.shared_size:
            out = out + self.shared_experts(h)
        elif self.c.shared_size:
            out = out + self.shared_expert(h) * torch.sigmoid(self.shared_expert_gate(h))
        return out.view_as(x), ids


class FusedExperts(nn.Module):
    """GPT-OSS's experts as transformers stores them (GptOssExperts): gate_up_proj [E, H, 2I]
    (inputs first; gate and up interleaved), down_proj [E, I, H], their biases; activation
    (clamp(up, -limit, limit) + 1) * g * sigmoid(1.702 g), g = gate clamped above at limit."""

    def __init__(self, c):
        super().__init__()
        E, H, I = c.num_experts, c.hidden_size, c.moe_intermediate
        self.limit = c.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.zeros(E, H, 2 * I))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(E, 2 * I))
        self.down_proj = nn.Parameter(torch.zeros(E, I, H))
        self.down_proj_bias = nn.Parameter(torch.zeros(E, H))

    def forward(self, h, ids, w):
        """h [T, H], ids and weights [T, K] -> sum_k w[t, k] expert_{ids[t, k]}(h[t])."""
        T, K = ids.shape
        contrib = h.new_zeros(T, K, h.shape[-1])
        for e in torch.unique(ids).tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            gu = h[tok] @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
            gate, up = gu[..., ::2].clamp(max=self.limit), gu[..., 1::2].clamp(-self.limit, self.limit)
            y = ((up + 1) * (gate * torch.sigmoid(gate * 1.702))) @ self.down_proj[e] + self.down_proj_bias[e]
            contrib[tok, slot] = y * w[tok, slot, None]
        return contrib.sum(dim=1)


class GateUpExperts(nn.Module):
    """Qwen3.5-MoE's experts as its vision-language release stores them: gate_up_proj [E, 2I, H]
    (gate rows, then up) and down_proj [E, H, I], nn.Linear's layout; SwiGLU."""

    def __init__(self, c):
        super().__init__()
        E, H, I = c.num_experts, c.hidden_size, c.moe_intermediate
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.zeros(E, H, I))

    def forward(self, h, ids, w):
        """h [T, H], ids and weights [T, K] -> sum_k w[t, k] expert_{ids[t, k]}(h[t])."""
        T, K = ids.shape
        I = self.down_proj.shape[-1]
        contrib = h.new_zeros(T, K, h.shape[-1])
        for e in torch.unique(ids).tolist():
            tok, slot = (ids == e).nonzero(as_tuple=True)
            gu = h[tok] @ self.gate_up_proj[e].t()
            y = (nn.functional.silu(gu[..., :I]) * gu[..., I:]) @ self.down_proj[e].t()
            contrib[tok, slot] = y * w[tok, slot, None]
        return contrib.sum(dim=1)


class DecoderLayer(nn.Module):
    def __init__(self, c, i):
        super().__init__()
        self.c = c
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.norm_offset)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.norm_offset)
        self.linear = c.linear_layers[i]
        if self.linear:
            self.linear_attn = GatedDeltaNet(c)
        else:
            self.self_attn = MlaAttention(c) if c.mla else Attention(c)
        if not c.mla and not self.linear:
            self.self_attn.window = c.windows[i]
        self.moe = i in c.moe_layers
        if c.arch == "mixtral":
            self.block_sparse_moe = SparseMoE(c)
        elif self.moe:
            self.mlp = SparseMoE(c)
        else:
            self.mlp = MLP(c.hidden_size, c.intermediate)

    def forward(self, x, cos, sin):
        h = self.input_layernorm(x)
        x = x + (self.linear_attn(h) if self.linear else self.self_attn(h, cos, sin))
        h = self.post_attention_layernorm(x)
        ids = None
        if self.c.arch == "mixtral":
            y, ids = self.block_sparse_moe(h)
        elif self.moe:
            y, ids = self.mlp(h)
        else:
            y = self.mlp(h)
        return x + y, ids


class MoEForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        c = self.config = config
        self.model = nn.Module()
        decoder = self.model
        if c.prefix == "model.language_model.":
            decoder = self.model.language_model = nn.Module()
        decoder.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        decoder.layers = nn.ModuleList(DecoderLayer(c, i) for i in range(c.num_layers))
        decoder.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, c.norm_offset)
        self.lm_head = linear(c.hidden_size, c.vocab_size)
        if c.tie_word_embeddings:
            self.lm_head.weight = decoder.embed_tokens.weight
        self.passthrough = {}  # stored tensors r3 does not run (MTP, a vision tower): written back as loaded

    @property
    def decoder(self):
        """The module holding embed_tokens, layers and norm (model, or model.language_model)."""
        return self.model.language_model if self.config.prefix == "model.language_model." else self.model

    def moe_blocks(self):
        """The MoE blocks in layer order (each has .replay, a RouterReplay)."""
        out = []
        for layer in self.decoder.layers:
            if self.config.arch == "mixtral":
                out.append(layer.block_sparse_moe)
            elif layer.moe:
                out.append(layer.mlp)
        return out

    def forward(self, input_ids):
        """input_ids [T] or [B, T] (sequences of one length) -> (logits [.., T, V] fp32, routes
        [.., T, L_moe, K]: the ids each MoE layer used)."""
        c = self.config
        single = input_ids.dim() == 1
        ids = input_ids[None] if single else input_ids
        B, T = ids.shape
        x = self.decoder.embed_tokens(ids)
        cos, sin = rope_tables(T, c.rotary_dim, c.rope_theta, x.device, c.yarn)
        routes = []
        for layer in self.decoder.layers:
            x, r = layer(x, cos, sin)
            if r is not None:
                routes.append(r.view(B, T, -1))
        logits = self.lm_head(self.decoder.norm(x)).float()
        routes = torch.stack(routes, dim=2)
        return (logits[0], routes[0]) if single else (logits, routes)

    def load_balancing_loss(self):
        """The auxiliary load-balancing loss of the last forward, as Switch / Mixtral / Qwen-MoE
        trainers add it (transformers' load_balancing_loss_func): per MoE layer E * sum_e f_e * P_e,
        f_e the fraction of routed slots that chose expert e and P_e its mean softmax probability;
        the mean over layers. It is what keeps trained routers balanced, with near-ties between
        experts, instead of collapsed onto a few."""
        losses = []
        for block in self.moe_blocks():
            logits, ids = block.last_router
            E = logits.shape[-1]
            f = torch.bincount(ids.reshape(-1), minlength=E).float() / ids.numel()
            P = torch.softmax(logits.float(), -1).mean(0)
            losses.append(E * (f * P).sum())
        return torch.stack(losses).mean()

    def set_replay(self, routes, action=RouterReplay.REPLAY_FORWARD):
        """Forces routes [T, L_moe, K] or [B, T, L_moe, K] (e.g. staged engine routes; -1 rows use
        the live router) on the next forward of every MoE layer."""
        routes = torch.as_tensor(routes, dtype=torch.long)
        routes = routes.reshape(-1, routes.shape[-2], routes.shape[-1])
        for l, block in enumerate(self.moe_blocks()):
            block.replay.set_target_indices(routes[:, l, :])
        RouterReplay.set_global_action(action, [b.replay for b in self.moe_blocks()])

    def clear_replay(self):
        for b in self.moe_blocks():
            b.replay.clear_indices()
        RouterReplay.set_global_action(None, [b.replay for b in self.moe_blocks()])

    @classmethod
    def from_pretrained(cls, model_dir, dtype=torch.float32):
        """Loads a Hugging Face checkpoint: every stored tensor must have a place in the model and
        every parameter a tensor (the tied lm_head may be absent), else ValueError naming it."""
        config = MoEConfig.from_dir(model_dir)
        state = load_state_dict(model_dir)
        config.fused_experts = config.arch == "qwen3_5_moe" and any(n.endswith(".mlp.experts.gate_up_proj") for n in state)
        model = cls(config)
        own = model.state_dict()
        # Not run, kept as loaded: DeepSeek-V3's MTP layers (model.layers.N + i), Qwen3-Next's and
        # Qwen3.5's (mtp.*) and a vision tower (model.visual.*), as r3's loader skips them by name.
        skip = tuple(f"model.layers.{config.num_layers + i}." for i in range(config.num_mtp_layers))
        if config.arch in _HYBRIDS:
            skip += ("mtp.", "model.visual.")
        model.passthrough = {n: t for n, t in state.items() if skip and n.startswith(skip)}
        state = {n: t for n, t in state.items() if n not in model.passthrough}
        unknown = [n for n in state if n not in own and not n.endswith("rotary_emb.inv_freq")]
        if unknown:
            raise ValueError(f"r3.torch: tensor {unknown[0]} of {model_dir} has no place in the model")
        missing = [n for n in own if n not in state and not (n == "lm_head.weight" and model.config.tie_word_embeddings)]
        if missing:
            raise ValueError(f"r3.torch: {model_dir} lacks tensor {missing[0]}")
        model.hf_dtypes = {n: t.dtype for n, t in state.items()}
        with torch.no_grad():
            for n, p in own.items():
                if n in state:
                    if tuple(state[n].shape) != tuple(p.shape):
                        raise ValueError(f"r3.torch: {n} is {tuple(state[n].shape)}, the config says {tuple(p.shape)}")
                    p.copy_(state[n].to(p.dtype))
        return model.to(dtype)

    def hf_state_dict(self):
        """Tensors by Hugging Face name (a tied lm_head left out, as the checkpoints store it)."""
        sd = self.state_dict()
        if self.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        sd.update(self.passthrough)
        return sd

    def checkpoint_dtypes(self):
        """The dtype each tensor is stored in: as loaded, else bf16 (fp32 for the selection bias)."""
        known = getattr(self, "hf_dtypes", {})
        return {n: known.get(n, self.passthrough[n].dtype if n in self.passthrough else
                             torch.float32 if n.endswith("e_score_correction_bias") else torch.bfloat16)
                for n in self.hf_state_dict()}

    def save_pretrained(self, out_dir, dtype=None):
        """config.json and model.safetensors; each tensor in its checkpoint dtype unless `dtype`."""
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(self.config.raw, f, indent=2)
        save_state_dict(self.hf_state_dict(), os.path.join(out_dir, "model.safetensors"),
                        dtype if dtype is not None else self.checkpoint_dtypes())
