"""The Gated DeltaNet layer of Qwen3-Next and Qwen3.5-MoE in PyTorch, in the recurrent form r3's
engine and fp32 reference compute (transformers' torch_recurrent_gated_delta_rule), token by token:

    mixed = in_proj_qkv h [C = 2 kd + vd: q, k, v channels];  z, b, a = in_proj_z/b/a h
    conv  = silu(causal depthwise conv of mixed over the last conv_kernel positions)
    per value head hv (key head hv // r): q, k L2-normalised (eps 1e-6), q /= sqrt(dk),
    decay = exp(-exp(A_log) softplus(a + dt_bias)), beta = sigmoid(b),
    S = decay S;  S += k (beta (v - S^T k))^T;  o = S^T q;  o = w * rmsnorm(o) * silu(z)

Qwen3-Next stores the projections combined (in_proj_qkvz, in_proj_ba: rows grouped per key head,
q_g, k_g, then v and z of the key head's r value heads; b then a likewise), Qwen3.5 apart
(in_proj_qkv head-major, in_proj_z, in_proj_b, in_proj_a). The module keeps the checkpoint's
names, so a checkpoint loads by name and writes back the same.
"""
import torch
from torch import nn


def l2_normalise(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    def __init__(self, c):
        super().__init__()
        d = c.deltanet
        self.c, self.d = c, d
        H, nk, nv, dk, dv = c.hidden_size, d["k_heads"], d["v_heads"], d["k_head_dim"], d["v_head_dim"]
        kd, vd = nk * dk, nv * dv
        C = 2 * kd + vd
        if d["combined"]:
            self.in_proj_qkvz = nn.Linear(H, 2 * kd + 2 * vd, bias=False)
            self.in_proj_ba = nn.Linear(H, 2 * nv, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(H, C, bias=False)
            self.in_proj_z = nn.Linear(H, vd, bias=False)
            self.in_proj_b = nn.Linear(H, nv, bias=False)
            self.in_proj_a = nn.Linear(H, nv, bias=False)
        K = d["conv_kernel"]
        self.conv1d = nn.Conv1d(C, C, K, groups=C, bias=False, padding=K - 1)  # weight [C, 1, K]
        self.dt_bias = nn.Parameter(torch.ones(nv))
        self.A_log = nn.Parameter(torch.zeros(nv))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(dv))  # the gated norm: plain w, not zero-centred
        self.out_proj = nn.Linear(vd, H, bias=False)

    def projections(self, x):
        """x [B, T, H] -> mixed [B, T, C] (the conv's channel order q, k, v), z [B, T, vd], b, a [B, T, nv]."""
        d = self.d
        B, T = x.shape[0], x.shape[1]
        nk, nv, dk, dv = d["k_heads"], d["v_heads"], d["k_head_dim"], d["v_head_dim"]
        if not d["combined"]:
            return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        r = nv // nk
        q, k, v, z = torch.split(self.in_proj_qkvz(x).view(B, T, nk, 2 * dk + 2 * r * dv), [dk, dk, r * dv, r * dv], -1)
        b, a = torch.split(self.in_proj_ba(x).view(B, T, nk, 2 * r), [r, r], -1)
        mixed = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], -1)
        return mixed, z.reshape(B, T, -1), b.reshape(B, T, -1), a.reshape(B, T, -1)

    def forward(self, x):
        """x [B, T, H] (normed) -> [B, T, H]."""
        d, eps = self.d, self.c.rms_norm_eps
        B, T = x.shape[0], x.shape[1]
        nk, nv, dk, dv = d["k_heads"], d["v_heads"], d["k_head_dim"], d["v_head_dim"]
        kd, r = nk * dk, nv // nk
        mixed, z, b, a = self.projections(x)
        # Causal: output t reads inputs t - (K - 1) .. t (Conv1d's left padding, the tail cut).
        conv = nn.functional.silu(self.conv1d(mixed.transpose(1, 2))[..., :T].transpose(1, 2))
        q = l2_normalise(conv[..., :kd].reshape(B, T, nk, dk)) * dk ** -0.5
        k = l2_normalise(conv[..., kd:2 * kd].reshape(B, T, nk, dk))
        v = conv[..., 2 * kd:].reshape(B, T, nv, dv)
        q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)  # value head hv reads key head hv // r
        decay = torch.exp(-torch.exp(self.A_log.float()) * nn.functional.softplus(a.float() + self.dt_bias.float()))
        beta = torch.sigmoid(b.float())
        S = x.new_zeros(B, nv, dk, dv, dtype=torch.float32)
        outs = []
        for t in range(T):
            S = S * decay[:, t, :, None, None]
            kt = k[:, t, :, :, None]                           # [B, nv, dk, 1]
            kv = (S * kt).sum(-2)                              # S^T k: [B, nv, dv]
            delta = (v[:, t] - kv) * beta[:, t, :, None]
            S = S + kt * delta[:, :, None, :]
            outs.append((S * q[:, t, :, :, None]).sum(-2))   # S^T q
        o = torch.stack(outs, 1)                               # [B, T, nv, dv]
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * self.norm.weight.float()
        o = o * nn.functional.silu(z.reshape(B, T, nv, dv).float())
        return self.out_proj(o.reshape(B, T, -1).to(x.dtype))
