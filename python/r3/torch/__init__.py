"""r3's trainer side in PyTorch (imported only when PyTorch is present: Debian's python3-torch).

MoEForCausalLM: r3's MoE architectures as torch modules that load Hugging Face checkpoints and
write them back. RouterReplay: Megatron-Core's router replay actions (record, replay forward,
replay backward) with the gate weights recomputed from the live router over the forced ids, as
each router type requires; patch_moe_block puts replay on a user's own MoE block.
"""
try:
    import torch
except ImportError as e:  # pragma: no cover - depends on the machine
    raise ImportError("r3.torch needs PyTorch (Debian: apt-get install python3-torch)") from e
del torch  # imported here only to fail early, with the reason, where PyTorch is missing

from .checkpoint import load_state_dict, save_state_dict
from .model import MoEConfig, MoEForCausalLM
from .replay import RouterReplay, gate_weights, patch_moe_block

__all__ = ["MoEConfig", "MoEForCausalLM", "RouterReplay", "gate_weights", "load_state_dict", "patch_moe_block",
           "save_state_dict"]
