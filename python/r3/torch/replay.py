"""Router replay for PyTorch trainers, with Megatron-Core's actions.

One RouterReplay per MoE router (layer). RECORD keeps the ids the live router chose; REPLAY_FORWARD
forces the ids given with set_target_indices (one [tokens, k] tensor per forward, in order) and
queues them for REPLAY_BACKWARD, which forces the same ids again when a recomputation (activation
checkpointing) runs the forward a second time. Rows that hold -1 fall back to the live router.
The gate weights are always recomputed from the live router's scores over the chosen ids, as the
router type requires, so gradients reach the router through them (gathering from the already
zeroed top-k probabilities would cut them).
"""
from collections import deque

import torch


class RouterReplay:
    RECORD = "record"
    REPLAY_FORWARD = "replay_forward"
    REPLAY_BACKWARD = "replay_backward"
    instances = []  # every router's instance, for the global action (Megatron's set_global_router_replay_action)

    def __init__(self):
        self.action = None
        self.target = deque()
        self.backward = deque()
        self.recorded = []
        RouterReplay.instances.append(self)

    @classmethod
    def set_global_action(cls, action, instances=None):
        for r in instances if instances is not None else cls.instances:
            r.action = action

    def set_target_indices(self, indices):
        """One [tokens, k] tensor per forward to come (a tensor: one forward)."""
        if isinstance(indices, torch.Tensor) and indices.dim() == 2:
            indices = [indices]
        self.target = deque(torch.as_tensor(x, dtype=torch.long) for x in indices)

    def get_recorded_indices(self):
        return self.recorded

    def clear_indices(self):
        self.target.clear()
        self.backward.clear()
        self.recorded = []

    def select(self, live_ids):
        """The ids this router uses: the live router's, or the forced ones (-1 rows: live)."""
        if self.action is None:
            return live_ids
        if self.action == self.RECORD:
            self.recorded.append(live_ids.detach().clone())
            return live_ids
        if self.action == self.REPLAY_FORWARD:
            if not self.target:
                raise RuntimeError("RouterReplay: no target indices left for this forward")
            forced = self.target.popleft()
            self.backward.append(forced)
        elif self.action == self.REPLAY_BACKWARD:
            if not self.backward:
                raise RuntimeError("RouterReplay: no indices queued for the backward recomputation")
            forced = self.backward.popleft()
        else:
            raise ValueError(f"RouterReplay: unknown action {self.action!r}")
        forced = forced.to(live_ids.device)
        if forced.shape != live_ids.shape:
            raise ValueError(f"RouterReplay: forced ids {tuple(forced.shape)} but the router chose {tuple(live_ids.shape)}")
        missing = (forced < 0).any(dim=1, keepdim=True)
        return torch.where(missing, live_ids, forced)


def live_topk(logits, router):
    """The live router's choice [T, k] for router = {"kind": "softmax" | "sigmoid" | "topk_softmax",
    "top_k", and for sigmoid: "bias" (selection only), "n_group", "topk_group"}."""
    k = router["top_k"]
    kind = router["kind"]
    if kind == "softmax":
        return torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1).indices
    if kind == "topk_softmax":
        return torch.topk(logits.float(), k, dim=-1).indices
    if kind == "sigmoid":
        sel = torch.sigmoid(logits.float())
        if router.get("bias") is not None:
            sel = sel + router["bias"]
        groups = router.get("n_group", 1)
        if groups > 1:
            T, E = sel.shape
            g = sel.view(T, groups, E // groups)
            group_score = torch.topk(g, 2, dim=-1).values.sum(dim=-1)
            keep = torch.topk(group_score, router.get("topk_group", groups), dim=-1).indices
            mask = torch.zeros(T, groups, dtype=torch.bool, device=sel.device).scatter_(1, keep, True)
            sel = sel.masked_fill(~mask.repeat_interleave(E // groups, dim=1), float("-inf"))
        return torch.topk(sel, k, dim=-1).indices
    raise ValueError(f"unknown router kind {kind!r}")


def gate_weights(logits, ids, router):
    """Gate weights [T, k] from the live logits at ids, as each router type computes them:
    softmax-first routers gather the full softmax (renormalised when router["renormalize"]);
    top-k-then-softmax routers (GPT-OSS) softmax the gathered logits; sigmoid routers gather the
    unbiased sigmoid scores, renormalise (+1e-20) and scale by router["scaling"]."""
    kind = router["kind"]
    logits = logits.float()
    if kind == "softmax":
        w = torch.softmax(logits, dim=-1).gather(1, ids)
        return w / w.sum(dim=-1, keepdim=True) if router.get("renormalize", False) else w
    if kind == "topk_softmax":
        return torch.softmax(logits.gather(1, ids), dim=-1)
    if kind == "sigmoid":
        w = torch.sigmoid(logits).gather(1, ids)
        if router.get("renormalize", True):
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return w * router.get("scaling", 1.0)
    raise ValueError(f"unknown router kind {kind!r}")


def patch_moe_block(block, router_logits, experts, router, replay=None):
    """Puts router replay on a user's own MoE block: its forward becomes
    router_logits(block, h) -> [T, E] logits; ids = live choice, forced by `replay`; weights
    recomputed from the live logits (gate_weights); experts(block, h, ids, weights) -> [T, H].
    Returns the RouterReplay (a new one unless given)."""
    replay = replay or RouterReplay()

    def forward(hidden_states, *args, **kwargs):
        shape = hidden_states.shape
        h = hidden_states.reshape(-1, shape[-1])
        logits = router_logits(block, h)
        ids = replay.select(live_topk(logits, router))
        return experts(block, h, ids, gate_weights(logits, ids, router)).reshape(shape)

    block.forward = forward
    block.router_replay = replay
    return replay
