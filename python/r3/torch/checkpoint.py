"""Hugging Face safetensors checkpoints to and from torch tensors (bf16, f16, f32), single file or
sharded with model.safetensors.index.json. Independent of r3's C++ reader. Block-scaled FP8
weights (quantization_config fp8, as DeepSeek-V3 is released) are read dequantized to bf16, each
weight the bf16 rounding of its e4m3 value times its block's scale: the values r3's engine
computes with."""
import json
import os
import struct

import numpy as np
import torch

_DTYPES = {"F32": (np.float32, torch.float32), "F16": (np.float16, torch.float16), "BF16": (np.int16, torch.bfloat16),
           "I64": (np.int64, torch.int64), "I32": (np.int32, torch.int32), "U8": (np.uint8, torch.uint8),
           "F8_E4M3": (np.uint8, torch.uint8)}


def _read_file(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        np_dtype, torch_dtype = _DTYPES[e["dtype"]]
        b, end = e["data_offsets"]
        arr = np.frombuffer(data[b:end], dtype=np_dtype).reshape(e["shape"]).copy()
        t = torch.from_numpy(arr)
        out[name] = t.view(torch.bfloat16) if torch_dtype is torch.bfloat16 else t
    return out


def load_state_dict(model_dir):
    """Every tensor of a checkpoint directory by its Hugging Face name."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        files = sorted(set(json.load(open(index))["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    state = {}
    for f in files:
        state.update(_read_file(os.path.join(model_dir, f)))
    config_path = os.path.join(model_dir, "config.json")
    quant = (json.load(open(config_path)).get("quantization_config") or {}) if os.path.exists(config_path) else {}
    if quant.get("quant_method") == "fp8":
        _dequantize_fp8(state, quant.get("weight_block_size") or [128, 128])
    return state


def _e4m3_values():
    """The 256 e4m3fn codes as float32 (0x7f and 0xff are NaN)."""
    b = np.arange(256)
    e, m = (b >> 3) & 15, (b & 7).astype(np.float64)
    v = np.where(e == 0, m * 2.0 ** -9, (8 + m) * 2.0 ** (e - 10))
    v = np.where((b & 0x7f) == 0x7f, np.nan, v)
    return np.where(b & 0x80, -v, v).astype(np.float32)


def _dequantize_fp8(state, block):
    br, bc = block
    values = _e4m3_values()
    for scale_name in [n for n in state if n.endswith(".weight_scale_inv")]:
        name = scale_name[:-len("_scale_inv")]
        codes = state[name].numpy()
        scales = state.pop(scale_name).float().numpy()
        rows, cols = codes.shape
        expanded = np.repeat(np.repeat(scales, br, 0), bc, 1)[:rows, :cols]
        state[name] = torch.from_numpy(values[codes] * expanded).to(torch.bfloat16)  # fp32 product, rounded once


def save_state_dict(state, path, dtype=torch.bfloat16):
    """Writes tensors as one safetensors file (header padded to 8 bytes, as Hugging Face does).
    dtype: one for all, or a dict by name (names it lacks: bf16)."""
    names = list(state)
    header, blobs, offset = {}, [], 0
    for name in names:
        dt = dtype.get(name, torch.bfloat16) if isinstance(dtype, dict) else dtype
        t = state[name].detach().to(dt).contiguous().cpu()
        raw = (t.view(torch.int16).numpy() if dt is torch.bfloat16 else t.numpy()).tobytes()
        header[name] = {"dtype": {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}[dt],
                        "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
