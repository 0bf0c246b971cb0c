"""The tensors of a checkpoint's safetensors files, from their headers alone: for the scripts
that read a checkpoint without r3 (full_size_tensor_refit.py, gguf_of_checkpoint.py)."""
import json
import os
import struct


def tensors_of(directory):
    """(name, file, dtype, shape, offset, nbytes) of every tensor of the checkpoint's files."""
    out = []
    for fname in sorted(os.listdir(directory)):
        if not fname.endswith(".safetensors"):
            continue
        path = os.path.join(directory, fname)
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        for name, e in header.items():
            if name == "__metadata__":
                continue
            begin, end = e["data_offsets"]
            out.append((name, path, e["dtype"], e["shape"], 8 + n + begin, end - begin))
    return out
