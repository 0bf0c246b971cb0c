"""Shared pieces of the Python tests."""
import json

import numpy as np


def prompt(n, salt):
    return [3 + (i * 37 + salt * 101) % 500 for i in range(n)]


def read_safetensors(path):
    """An independent reader: header JSON, then numpy views (bf16 as uint16 bits, F8_E4M3 as uint8 codes)."""
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    dt = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U8": np.uint8, "F8_E4M3": np.uint8}
    return {k: np.frombuffer(data[e["data_offsets"][0]:e["data_offsets"][1]], dtype=dt[e["dtype"]]).reshape(e["shape"])
            for k, e in header.items() if k != "__metadata__"}


CHAT_TEMPLATE = ("{%- for message in messages %}"
                 "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
                 "{%- endfor %}"
                 "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def byte_level_chars():
    """GPT-2's byte-to-character table."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    out, n = {}, 0
    for b in range(256):
        if b in printable:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


def write_test_tokenizer(directory):
    """A small byte-level BPE tokenizer.json in the releases' layout, with a chat template."""
    import os
    os.makedirs(directory, exist_ok=True)
    chars = byte_level_chars()
    vocab = {chars[b]: b for b in range(256)}
    G = chars[ord(" ")]
    merges = [(G, "t"), ("h", "e"), (G + "t", "he"), ("i", "n"), (G, "a"), ("a", "n"), ("an", "d"), (G, "and")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    added = [{"id": len(vocab) + i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, c in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tj = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": {"type": "NFC"},
          "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
              {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}|"
                                                     " ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"},
               "behavior": "Isolated", "invert": False}, byte_level]},
          "post_processor": byte_level, "decoder": byte_level,
          "model": {"type": "BPE", "dropout": None, "unk_token": None, "fuse_unk": False, "byte_fallback": False,
                    "ignore_merges": False, "vocab": vocab, "merges": [list(m) for m in merges]}}
    with open(os.path.join(directory, "tokenizer.json"), "w") as f:
        json.dump(tj, f)
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": None, "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}, f)
    return directory
