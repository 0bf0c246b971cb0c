"""Shared pieces of the Python tests."""
import json

import numpy as np


def prompt(n, salt):
    return [3 + (i * 37 + salt * 101) % 500 for i in range(n)]


def read_safetensors(path):
    """An independent reader: header JSON, then numpy views (bf16 as uint16 bits)."""
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    dt = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}
    return {k: np.frombuffer(data[e["data_offsets"][0]:e["data_offsets"][1]], dtype=dt[e["dtype"]]).reshape(e["shape"])
            for k, e in header.items() if k != "__metadata__"}
