"""Model FLOPs per token, the device's peak, and the memory a log window used: tflops_per_s, mfu, memory.

FLOPs per trained token = 6·N + 12·L·H·Q·T (PaLM, appendix B; torchtitan): N the parameters that multiply
activations (every matrix but the input embedding; the LM head counted even when tied to it; an MoE's experts
scaled by top-k / experts), L layers, H attention heads, Q head size, T the sequence length. 6 = 2 (multiply-add)
x 3 (forward, and backward for inputs and for weights); the attention term is QK^T and AV over the whole window,
as FlopCounterMode counts sdpa (causal masking is not subtracted). A forward alone is a third of that.
"""

from __future__ import annotations

import resource
import sys

import torch
from torch import nn

# Dense peak TFLOP/s of one device (vendor datasheets, SXM / no sparsity): (bf16, fp32). fp32 is plain FP32,
# not TF32 (treadle does not switch TF32 on). Matched against torch.cuda.get_device_name, first hit wins.
PEAK_TFLOPS = {
    "H200": (989.0, 67.0),
    "H100 PCIe": (756.0, 51.0),
    "H100": (989.0, 67.0),
    "A100": (312.0, 19.5),
    "L40S": (362.0, 91.6),
    "L4": (121.0, 30.3),
    "A10G": (70.0, 31.2),
    "RTX 4090": (165.0, 82.6),
}


# fp8's dense peak is twice bf16's on every card with float8 tensor cores (the Hopper and Ada datasheets: H100 SXM
# 1,979 against 989 TFLOP/s; L40S 733 against 362); fp8 runs only there (models/fp8.py).
FP8_OVER_BF16 = 2.0


def peak_tflops(device: torch.device, dtype: str, configured: float | None) -> float | None:
    """One device's peak for this run's ``model.dtype``: the configured one, a known GPU's, else None (CPU: no
    mfu). bf16 and bf16-weights: its bf16 peak; fp8: twice that (the matmuls torchao leaves in bf16 are counted
    against it too, so an fp8 run's MFU reads low beside a bf16 run's at the same speed); else fp32's."""
    if configured is not None:
        return configured
    if device.type != "cuda":
        return None
    return device_peak(torch.cuda.get_device_name(device), dtype)


def device_peak(name: str, dtype: str) -> float | None:
    """``peak_tflops`` of the GPU named ``name`` (as torch.cuda.get_device_name says it), None if unknown."""
    pair = next((pair for key, pair in PEAK_TFLOPS.items() if key in name), None)
    if pair is None:
        return None
    return pair[0] * FP8_OVER_BF16 if dtype == "fp8" else pair[0] if dtype in ("bf16", "bf16-weights") else pair[1]


def matmul_parameters(model: nn.Module) -> float:
    """N of the formula: parameters of 2+ dimensions but the input embedding's, the head's counted once."""
    skip = {id(model.get_input_embeddings().weight)} if hasattr(model, "get_input_embeddings") else set()
    config = getattr(model, "config", None)
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    total = 0.0
    for name, p in model.named_parameters(remove_duplicate=False):
        if p.dim() < 2 or id(p) in skip:
            continue
        n = float(getattr(p, "ds_numel", 0) or p.numel())  # ZeRO-3 partitions keep their full size in ds_numel
        total += n * top_k / experts if experts and top_k and ".experts." in f".{name}." else n
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and id(head.weight) in skip:  # tied: the head's matmul is real work all the same
        total += float(getattr(head.weight, "ds_numel", 0) or head.weight.numel())
    return total


def attention_dims(config) -> tuple[int, int, int]:
    """(L, H, Q) of an HF config; Q the mean over the layers where they differ (Gemma 4's per-layer head_dim: its
    config refuses a global read)."""
    heads, layers = config.num_attention_heads, config.num_hidden_layers

    def head_dim(c) -> int:
        return getattr(c, "head_dim", None) or config.hidden_size // heads

    if getattr(config, "per_layer_config", None):  # transformers 5.24 gives every config one (most say nothing)
        return layers, heads, round(sum(head_dim(config.per_layer_config[i]) for i in range(layers)) / layers)
    return layers, heads, head_dim(config)


def train_flops_per_token(n: float, layers: int, heads: int, head_dim: int, seq_len: int) -> float:
    return 6.0 * n + 12.0 * layers * heads * head_dim * seq_len


def forward_flops_per_token(n: float, layers: int, heads: int, head_dim: int, seq_len: int) -> float:
    return train_flops_per_token(n, layers, heads, head_dim, seq_len) / 3.0


def memory_window(device: torch.device) -> dict[str, float]:
    """Peak memory in GiB since the last call (CUDA: allocated and reserved by torch, then reset), or on a CPU the
    process's peak resident set since it started (the kernel keeps no window)."""
    if device.type == "cuda":
        out = {"memory_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
               "memory_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}
        torch.cuda.reset_peak_memory_stats(device)
        return out
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {"peak_rss_gib": (rss if sys.platform == "darwin" else rss * 1024) / 2**30}
