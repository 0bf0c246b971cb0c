"""A GGUF file of an r3-written Qwen3-MoE checkpoint (bf16, every layer MoE, a tokenizer.json
beside it), for running the same seeded weights in llama.cpp or ik_llama.cpp side by side with r3
(docs/BENCHMARKS.md, "Side by side with ik_llama.cpp"). Writes what their converter
(convert_hf_to_gguf.py, class Qwen3MoeModel) writes, without the transformers package it needs:
the qwen3moe hyperparameters, a gpt2-style vocabulary read from tokenizer.json (pre-tokenizer
"qwen2"), and every tensor in bf16 under GGUF's names, each layer's experts stacked into one
tensor per projection (norms and the router widened to f32, as their converter keeps them).

    PYTHONPATH=IK_LLAMA/gguf-py /usr/bin/python3 scripts/gguf_of_checkpoint.py MODEL_DIR OUT.gguf

The checkpoint: `r3 make-model --arch qwen3_moe --preset bench --seed 1 --config-patch
'{"mlp_only_layers": []}' --tokenizer DIR --out MODEL_DIR` (llama.cpp's qwen3moe has no dense
layers). gguf (the gguf-py package) comes from the llama.cpp or ik_llama.cpp checkout.
"""
import json
import os
import sys

import numpy as np

from safetensors_index import tensors_of  # beside this script

try:
    import gguf
except ImportError:
    sys.exit("gguf not found: set PYTHONPATH to the gguf-py folder of a llama.cpp or ik_llama.cpp checkout")


def read(entry):
    path, dtype, shape, offset, nbytes = entry[1:]
    if dtype != "BF16":
        sys.exit(f"{path}: {dtype} tensors are not converted (bf16 checkpoints only)")
    with open(path, "rb") as f:
        f.seek(offset)
        return np.frombuffer(f.read(nbytes), dtype=np.uint16).reshape(shape)


def vocabulary(directory, vocab_size):
    """tokens, types and merges as convert_hf_to_gguf.py's gpt2 vocabulary writes them."""
    with open(os.path.join(directory, "tokenizer.json")) as f:
        tj = json.load(f)
    by_id = {i: t for t, i in tj["model"]["vocab"].items()}
    types = {i: gguf.TokenType.NORMAL for i in by_id}
    for added in tj.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
        types[added["id"]] = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
    tokens, token_types = [], []
    for i in range(vocab_size):
        tokens.append(by_id.get(i, f"[PAD{i}]"))
        token_types.append(types.get(i, gguf.TokenType.UNUSED))
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"].get("merges", [])]
    return tokens, token_types, merges


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    src, out = sys.argv[1], sys.argv[2]
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    if cfg.get("model_type") != "qwen3_moe" or cfg.get("mlp_only_layers"):
        sys.exit("a qwen3_moe checkpoint with every layer MoE (mlp_only_layers []) is needed")
    if not os.path.exists(os.path.join(src, "tokenizer.json")):
        sys.exit("the checkpoint has no tokenizer.json (make-model --tokenizer DIR)")
    L, E = cfg["num_hidden_layers"], cfg["num_experts"]
    w = gguf.GGUFWriter(out, "qwen3moe")
    w.add_block_count(L)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(E)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    tokens, types, merges = vocabulary(src, cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_add_bos_token(False)

    t = {entry[0]: entry for entry in tensors_of(src)}
    bf16 = gguf.GGMLQuantizationType.BF16

    def put(name, array):
        # As their converter: norms (1-D) and the router in f32 (the same values: a bf16 widens
        # exactly), the rest as stored.
        if array.ndim == 1 or name.endswith("ffn_gate_inp.weight"):
            w.add_tensor(name, (array.astype(np.uint32) << 16).view(np.float32))
        else:
            w.add_tensor(name, array, raw_shape=array.shape, raw_dtype=bf16)

    put("token_embd.weight", read(t["model.embed_tokens.weight"]))
    put("output_norm.weight", read(t["model.norm.weight"]))
    put("output.weight", read(t["lm_head.weight"]))
    for i in range(L):
        p = f"model.layers.{i}."
        for ours, theirs in [("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"),
                             ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"),
                             ("self_attn.v_proj", "attn_v"), ("self_attn.o_proj", "attn_output"),
                             ("self_attn.q_norm", "attn_q_norm"), ("self_attn.k_norm", "attn_k_norm"),
                             ("mlp.gate", "ffn_gate_inp")]:
            put(f"blk.{i}.{theirs}.weight", read(t[p + ours + ".weight"]))
        for ours, theirs in [("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"),
                             ("down_proj", "ffn_down_exps")]:
            put(f"blk.{i}.{theirs}.weight",
                np.stack([read(t[f"{p}mlp.experts.{e}.{ours}.weight"]) for e in range(E)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {out}: {L} layers, {E} experts, vocabulary {len(tokens)}")


if __name__ == "__main__":
    main()
