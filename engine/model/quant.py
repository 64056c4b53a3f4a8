"""int8 weights with one scale per output channel (`--weight-dtype int8`).

A weight W [N, K] is kept as codes Q [N, K] int8 and scales s [N] fp32 with s[n] = max_k |W[n, k]| / 127 and
Q = round(W / s) (symmetric, codes in -127..127), computed at load from the checkpoint's own tensors (the GGUF
loader's fp32 dequantisation, or a folder's bf16/fp32) row by row, so no bf16 copy of the weight is ever made.
What is quantised: each decoder layer's fused q|k|v, o, fused gate|up and down projections, and the LM head; with
tied embeddings the embedding table is the LM head's tensor, so its lookups dequantise the rows they read.

A product reads Q and applies s to its fp32 sums: x W^T ~ (x Q^T) * s. The CPU kernels (engine/kernels/
int8_linear.cpp) do that for decode-sized row counts: on AVX-512 VNNI against x quantised to int8 in groups of
32 (`W8A8_GROUP`), on the copy of Q `pack_w8a8` makes once per model; elsewhere on Q widened to fp32. Larger row
counts (and every other backend) dequantise Q * s to the activations' dtype and run F.linear (`dequantize`,
`linear_int8`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import WEIGHT_DTYPES

if TYPE_CHECKING:
    from engine.model.llama import LlamaModel

INT8_MAX = 127
DEQUANT_CHUNK_ROWS = 8192  # F.linear on at most this many dequantised output channels at once (the LM head's 49k)


def resolve_weight_dtype(name: str) -> Literal["bfloat16", "int8"]:
    """'auto' keeps the serving dtype's weights (bfloat16): the kernels take no GGUF-native block format yet."""
    if name not in WEIGHT_DTYPES:
        raise ValueError(f"weight dtype must be one of {', '.join(WEIGHT_DTYPES)}, not {name!r}")
    return "bfloat16" if name == "auto" else name


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (any float dtype) -> (codes [N, K] int8, scales [N] fp32): per-row absmax / 127. A row of
    zeros gets scale 1 (codes 0)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / INT8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(w / scale.unsqueeze(1)).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scale


W8A8_GROUP = 32  # activation codes per scale in the W8A8 kernel (its packed copy pads K to a multiple)
W8A8_CHANNELS = 16  # output channels per packed block: one int32 lane each


def pack_w8a8(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K] int8 -> the W8A8 kernel's copy, uint8 [ceil(N / 16), ceil(K / 32) * 8, 16, 4]:
    packed[b, j, c, t] = codes[16 b + c, 4 j + t] + 128 (0 + 128 past N and K). One 64-byte vector holds 4
    consecutive k of 16 channels, unsigned as vpdpbusd's first operand must be."""
    n, k = codes.shape
    blocks, kp = -(-n // W8A8_CHANNELS), -(-k // W8A8_GROUP) * W8A8_GROUP
    padded = torch.zeros(blocks * W8A8_CHANNELS, kp, dtype=torch.int16)
    padded[:n, :k] = codes
    shifted = (padded + 128).to(torch.uint8)
    return shifted.view(blocks, W8A8_CHANNELS, kp // 4, 4).permute(0, 2, 1, 3).contiguous()


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [N, K] int8, scale [N] fp32 -> codes * scale [N, K] in `dtype`, one rounding per element (the
    codes are exact in bf16). decode_stack.cpp's prefill path computes the same."""
    return codes.to(dtype).mul_(scale.unsqueeze(1))


def linear_int8(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] -> x (codes * scale)^T + bias [M, N] by F.linear on the weight dequantised to x's dtype, at most
    DEQUANT_CHUNK_ROWS output channels at a time (so that the transient copy stays small)."""
    n = codes.shape[0]
    if n <= DEQUANT_CHUNK_ROWS:
        return F.linear(x, dequantize(codes, scale, x.dtype), bias)
    return torch.cat([F.linear(x, dequantize(codes[i:i + DEQUANT_CHUNK_ROWS], scale[i:i + DEQUANT_CHUNK_ROWS],
                                             x.dtype), None if bias is None else bias[i:i + DEQUANT_CHUNK_ROWS])
                      for i in range(0, n, DEQUANT_CHUNK_ROWS)], dim=-1)


def embed_int8(codes: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The embedding rows of `ids` from an int8 table: codes[ids] * scale[ids] in `dtype`."""
    return codes[ids].to(dtype).mul_(scale[ids].unsqueeze(1))


def int8_layout(model: LlamaModel, device: torch.device | str) -> None:
    """On a model still on the meta device (before its storage is made): every weight `quantized_weights` names
    becomes an int8 parameter, with its fp32 scales [N] (real storage, filled by load_weights) beside it as the
    module's `weight_scale`."""
    for module in quantized_modules(model):
        rows, cols = module.weight.shape
        module.weight = nn.Parameter(torch.empty(rows, cols, dtype=torch.int8, device="meta"), requires_grad=False)
        module.weight_scale = torch.empty(rows, dtype=torch.float32, device=device)


def quantized_modules(model: LlamaModel) -> list[nn.Module]:
    """The modules whose weight --weight-dtype int8 quantises: the layers' four projections and the LM head (the
    embedding table where it is tied)."""
    modules: list[nn.Module] = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        modules += [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
    modules.append(model.embed_tokens if model.lm_head is None else model.lm_head)
    return modules


def weight_scales(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameter name of each int8 weight -> its scales."""
    return {f"{name}.weight" if name else "weight": module.weight_scale for name, module in model.named_modules()
            if getattr(module, "weight_scale", None) is not None}
