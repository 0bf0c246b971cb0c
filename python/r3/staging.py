"""Trainer-side staging of routes, numpy in and out, for routes from any engine.

An RL rollout is a sequence of engine calls (turns). Each call returns routes for the tokens it
ran, [T-1, L, K] (or a delta from `start`); the trainer needs one row per token of the whole
rollout, [T_total, L, K], to replay the engine's routing:

    calls = [stage_call(decode_routes(reply_i, "sglang", num_hidden_layers=48, top_k=8,
                                      moe_layers=moe_layers),
                        prev_len_i, total_len_i, num_experts, start=start_i, filler="spread")
             for each call i]
    rows, report = assemble_rollout(calls)        # [T_total, L, K], turn boundaries repaired

`stage_call` appends a filler row for the call's last token (the engine routed no token after
it): "minus_one" (the trainer's router decides), "arange" (experts 0..K-1) or "spread" (forced ids
that move with the position and the layer, so padding does not pile onto one expert or rank) and
keeps the call's new rows [prev_len, T). Policies, as the staging document has them: "strict"
raises r3.Error for a call with any bad or missing row (partly -1, duplicate or out-of-range ids,
an all -1 engine row, the wrong row count); "lenient" drops the whole call's routes with a
warning (its rows become -1, the trainer's router decides them) and keeps the rollout.
`assemble_rollout` joins the calls and repairs turn boundaries: when call i+1's reply covers
position prev_len-1, its real route replaces call i's filler row.

Wire formats (`decode_routes` / `encode_routes`): "sglang" (base64 of little-endian int32
[rows, num_hidden_layers, K], every decoder layer; pass moe_layers to keep the MoE columns), "vllm"
(base64 of an .npy array over the MoE layers), "r3" (DESIGN.md's transport object, a dict or its
JSON text) and "nrlre1" (NeMo-RL's envelope string). `moe_layers_only` and `all_layers` convert
between the two layer axes. `alignment_metrics` scores train/inference mismatch from arrays.
Arrays come back as int32. `decode_route_weights` reads the gate weights a reply carries beside
its routes when asked (`return_routed_expert_weights`) as float32 in the same shape.
"""
import base64
import io
import json
import warnings

import numpy as np

from ._r3 import Error
from ._r3 import _staging as _native

StagedCall = _native.StagedCall
FILLERS = ("minus_one", "arange", "spread")
POLICIES = ("strict", "lenient")
VERSION_POLICIES = ("keep", "drop_call", "fail")
FORMATS = ("sglang", "vllm", "r3", "nrlre1")

__all__ = ["FILLERS", "FORMATS", "POLICIES", "VERSION_POLICIES", "StagedCall", "alignment_metrics", "all_layers", "assemble_rollout",
           "decode_route_weights", "decode_routes", "encode_routes", "moe_layers_only", "stage_call", "validate_routes"]


def stage_call(routes, prev_len, total_len, num_experts, *, start=0, filler="minus_one", policy="strict",
               call_index=0, weight_versions=None):
    """One call's rows [total_len - prev_len, L, K] from its engine routes.

    routes: the engine's rows for positions [start, total_len - 1) (None: the engine sent none).
    Under the lenient policy a bad call warns (RuntimeWarning) and comes back with ok False.
    weight_versions: the call's per-generated-token weight versions (r3's
    meta_info["weight_versions"] / CompletionOutput.weight_versions); then `versions` holds the
    version each kept row was computed under, for assemble_rollout's version_policy."""
    call = _native.stage_call(None if routes is None else np.asarray(routes), int(prev_len), int(total_len),
                              int(num_experts), start=int(start), filler=filler, policy=policy,
                              call_index=int(call_index),
                              weight_versions=[int(v) for v in (weight_versions or [])])
    if not call.ok:
        warnings.warn(call.warning, RuntimeWarning, stacklevel=2)
    return call


def assemble_rollout(calls, repair_boundaries=True, version_policy="keep"):
    """Joins staged calls (contiguous: each call's prev_len is the previous call's total_len)
    into [T_total, L, K]; returns (rows, {"repaired_boundary_rows", "filler_rows", "versions",
    "mixed_versions", "version_dropped_calls"}).

    A rollout whose rows span weight versions (a refit landed while it ran) is reported
    (mixed_versions, and versions per row when every call was staged with weight_versions);
    version_policy decides what the trainer gets: "keep" every row, "drop_call" (the routes of
    each call holding a row older than the newest become -1, the trainer's router decides them)
    or "fail" (r3.Error naming the calls)."""
    return _native.assemble_rollout(list(calls), bool(repair_boundaries), version_policy)


def validate_routes(routes, num_experts):
    """The checks NeMo-RL applies to a route tensor [rows, L, K]: rows that are partly -1, ids
    out of [0, num_experts), duplicate ids within a (row, layer). Returns a list of problems
    (empty: valid); all -1 rows are allowed (missing routes the trainer's router decides)."""
    a = np.asarray(routes)
    if a.ndim != 3:
        return [f"expected [rows, layers, K], got shape {a.shape}"]
    problems = []
    minus = (a == -1)
    rows_minus = minus.reshape(a.shape[0], -1)
    partly = np.where(rows_minus.any(axis=1) & ~rows_minus.all(axis=1))[0]
    for r in partly[:5]:
        problems.append(f"row {r} is partly -1")
    bad = np.argwhere(~minus & ((a < 0) | (a >= num_experts)))
    for r, l, j in bad[:5]:
        problems.append(f"row {r} layer {l} has expert id {a[r, l, j]} outside [0, {num_experts})")
    s = np.sort(a, axis=2)
    dup = np.argwhere(((s[:, :, 1:] == s[:, :, :-1]) & (s[:, :, 1:] != -1)).any(axis=2))
    for r, l in dup[:5]:
        problems.append(f"row {r} layer {l} repeats an expert id")
    return problems


def moe_layers_only(routes, moe_layers):
    """[rows, num_hidden_layers, K] (every decoder layer) -> [rows, len(moe_layers), K]."""
    return np.ascontiguousarray(np.asarray(routes)[:, list(moe_layers), :]).astype(np.int32)


def all_layers(routes, moe_layers, num_hidden_layers, fill=0):
    """[rows, len(moe_layers), K] -> [rows, num_hidden_layers, K]; dense layers hold `fill`
    (0, as SGLang's capturer leaves them)."""
    a = np.asarray(routes)
    out = np.full((a.shape[0], num_hidden_layers, a.shape[2]), fill, dtype=np.int32)
    out[:, list(moe_layers), :] = a
    return out


def decode_routes(payload, fmt, *, num_hidden_layers=None, top_k=None, moe_layers=None):
    """A route payload in one of FORMATS -> int32 [rows, L, K].

    sglang: needs num_hidden_layers and top_k; with moe_layers, only those columns are kept
    (else every decoder layer). r3: a dict or JSON text (its own start and moe_layers are in it).
    vllm and nrlre1: self-describing."""
    if fmt == "sglang":
        if num_hidden_layers is None or top_k is None:
            raise Error("decode_routes(..., 'sglang') needs num_hidden_layers and top_k")
        layers = list(moe_layers) if moe_layers is not None else list(range(num_hidden_layers))
        return _native.decode_sglang(payload, int(num_hidden_layers), int(top_k), layers)
    if fmt == "vllm":
        return _native.decode_vllm(payload)
    if fmt == "r3":
        text = payload if isinstance(payload, str) else json.dumps(payload)
        rows, _start, _layers = _native.decode_r3(text)
        return rows
    if fmt == "nrlre1":
        return _native.decode_nrlre1(payload)
    raise Error(f"unknown route format {fmt!r} (one of {', '.join(FORMATS)})")


def decode_route_weights(payload, fmt, *, num_hidden_layers=None, top_k=None, moe_layers=None):
    """The gate weights a reply carries beside its routes (``routed_expert_weights``, asked for with
    ``return_routed_expert_weights``) -> float32 [rows, L, K], the ids' rows and order.

    r3 and nrlre1: r3's transport object with dtype float32 (a dict or JSON text); sglang: base64
    of little-endian float32 [rows, num_hidden_layers, K] (needs num_hidden_layers and top_k;
    with moe_layers only those columns are kept); vllm: base64 of a float32 .npy."""
    if fmt in ("r3", "nrlre1"):
        obj = json.loads(payload) if isinstance(payload, str) else payload
        if obj.get("dtype") != "float32":
            raise Error(f"route weights: dtype must be float32, got {obj.get('dtype')!r}")
        return np.frombuffer(base64.b64decode(obj["data"]), dtype="<f4").reshape(obj["shape"])
    if fmt == "sglang":
        if num_hidden_layers is None or top_k is None:
            raise Error("decode_route_weights(..., 'sglang') needs num_hidden_layers and top_k")
        a = np.frombuffer(base64.b64decode(payload), dtype="<f4")
        a = a.reshape(-1, int(num_hidden_layers), int(top_k))
        return a[:, list(moe_layers), :] if moe_layers is not None else a
    if fmt == "vllm":
        return np.load(io.BytesIO(base64.b64decode(payload)), allow_pickle=False)
    raise Error(f"unknown route format {fmt!r} (one of {', '.join(FORMATS)})")


def encode_routes(routes, fmt, *, moe_layers=None, num_hidden_layers=None, start=0):
    """int [rows, L_moe, K] -> a payload in one of FORMATS (sglang needs moe_layers and
    num_hidden_layers; r3 gives a dict)."""
    a = np.asarray(routes)
    if fmt == "sglang":
        if moe_layers is None or num_hidden_layers is None:
            raise Error("encode_routes(..., 'sglang') needs moe_layers and num_hidden_layers")
        return _native.encode_sglang(a, list(moe_layers), int(num_hidden_layers))
    if fmt == "vllm":
        return _native.encode_vllm(a)
    if fmt == "r3":
        return json.loads(_native.encode_r3(a, int(start), list(moe_layers or [])))
    if fmt == "nrlre1":
        return _native.encode_nrlre1(a)
    raise Error(f"unknown route format {fmt!r} (one of {', '.join(FORMATS)})")


def alignment_metrics(engine_routes, trainer_routes, engine_logprobs, trainer_logprobs, extreme_threshold=2.0):
    """Train/inference mismatch of one rollout: router disagreement between the engine's routes
    and the trainer's own [T, L, K] (rows with any -1 in either are left out and counted), and the
    logprob mismatch of the sampled tokens [T] (k3 KL, extreme-token fraction, |d logprob|)."""
    return _native.alignment_metrics(np.asarray(engine_routes), np.asarray(trainer_routes),
                                     [float(x) for x in engine_logprobs], [float(x) for x in trainer_logprobs],
                                     float(extreme_threshold))
