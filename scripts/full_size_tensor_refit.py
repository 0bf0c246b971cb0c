"""A refit from tensors of a real-size checkpoint (issue 42): the Python LLM receives the
checkpoint's own tensors back, one bucket per decoder layer (and one per tensor outside the
layers, the embedding and lm_head being the largest), as a trainer sends its buckets; reports the
peak resident memory above the loaded engine against the bound 1.10 x checkpoint + KV pool +
512 MB, and checks the output after the refit equals the output before (the same weights).

    R3_BUILD=build /usr/bin/python3 scripts/full_size_tensor_refit.py MODEL_DIR

The sender's copy of a bucket lives in this process too (numpy arrays read from the files, then
the engine's copy of them), so the peak counts about two buckets beyond the weights.
"""
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, os.environ.get("R3_BUILD", "build"), "python"))
import r3  # noqa: E402
from safetensors_index import tensors_of  # noqa: E402 (beside this script)

NUMPY = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32, "U8": np.uint8,
         "F8_E4M3": np.uint8, "I8": np.uint8}


def status_kb(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    return 0


def read(path, dtype, shape, offset, nbytes):
    with open(path, "rb") as f:
        f.seek(offset)
        a = np.fromfile(f, dtype=NUMPY[dtype], count=nbytes // np.dtype(NUMPY[dtype]).itemsize)
    return a.reshape(shape)


def main():
    directory = sys.argv[1]
    llm = r3.LLM(model=directory, kv_cache_mb=1024)
    params = r3.SamplingParams(max_tokens=8, temperature=0)
    prompt = [[100 + j for j in range(7)]]
    before = llm.generate(prompt, params)[0].outputs[0]
    resident_mb = status_kb("VmRSS:") / 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM starts again from VmRSS
    all_tensors = tensors_of(directory)
    buckets = {}
    for t in all_tensors:
        parts = t[0].split(".")
        layer = int(parts[parts.index("layers") + 1]) if "layers" in parts else None
        buckets.setdefault(("layer", layer) if layer is not None else ("alone", t[0]), []).append(t)
    keys = list(buckets)
    stored_mb = sum(t[5] for t in all_tensors) / 2**20
    largest_mb = 0
    start = time.time()
    for i, key in enumerate(keys):
        named = [(t[0], read(*t[1:])) for t in buckets[key]]
        largest_mb = max(largest_mb, sum(a.nbytes for _, a in named) / 2**20)
        llm.update_weights_from_tensors(named, flush_cache=True, finished=i == len(keys) - 1)
        del named
    seconds = time.time() - start
    peak_mb = status_kb("VmHWM:") / 1024
    after = llm.generate(prompt, params)[0].outputs[0]
    kv_mb = 1024
    bound_mb = 1.10 * stored_mb + kv_mb + 512
    print(f"refit from tensors in {len(keys)} buckets (largest {largest_mb:.0f} MB): {seconds:.1f} s; "
          f"resident before {resident_mb:.0f} MB, peak during {peak_mb:.0f} MB "
          f"(+{peak_mb - resident_mb:.0f} MB); bound 1.10 x {stored_mb:.0f} MB + KV {kv_mb} MB + 512 MB "
          f"= {bound_mb:.0f} MB: {'met' if peak_mb <= bound_mb else 'NOT met'}")
    same = list(after.token_ids) == list(before.token_ids) and list(after.logprobs or []) == list(
        before.logprobs or [])
    print(f"after the refit, the same tokens and logprobs as before: {same}")
    return 0 if same and peak_mb <= bound_mb else 1


if __name__ == "__main__":
    sys.exit(main())
