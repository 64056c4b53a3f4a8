"""OLMo 2 (transformers' Olmo2ForCausalLM), written for a paged KV cache on the Llama decoder's parts.

It differs from Llama in its layer: no norm before attention or the MLP; instead each sub-block's output is
normalised before it joins the residual stream (post_attention_layernorm, post_feedforward_layernorm), and q and
k are normalised over their whole projections (one RMSNorm of q_size weights and one of kv_size, not one per
head as Qwen3's) before RoPE. Embeddings, RoPE, the SiLU MLP, the final norm and the LM head are Llama's.

The products and norms run on the backend through the shared Linear and RMSNorm (engine/model/layers.py), so the
backend's kernels serve this model as they serve Llama's; only the fused decode step, which computes Llama's
layer, does not (decode_stack_spec).
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from engine.backends.attention import AttentionMetadata
from engine.backends.base import Rope, StackLayer, StackShape
from engine.backends.weight_ops import Weight
from engine.config import ModelConfig
from engine.model.layers import PreparedWeights, RMSNorm
from engine.model.llama import MLP, Attention, LlamaModel


class Olmo2Attention(Attention):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__(cfg, layer)
        self.q_norm = RMSNorm(cfg.q_size, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.kv_size, cfg.rms_norm_eps)

    def _norm_qk(self, qkv: torch.Tensor, prepared: PreparedWeights) -> None:
        """Normalises q and k of qkv [T, q_size + 2 * kv_size] each over its whole projection, in place."""
        c = self.cfg
        for norm, start, size in ((self.q_norm, 0, c.q_size), (self.k_norm, c.q_size, c.kv_size)):
            part = qkv[:, start:start + size]  # rows strided by the fused width
            part.copy_(norm(part.contiguous(), prepared))


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, meta: AttentionMetadata,
                kv: tuple[torch.Tensor, torch.Tensor], prepared: PreparedWeights,
                keep_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As DecoderLayer.forward: x is the previous layer's normalised MLP output, not yet added."""
        residual = x if residual is None else residual + x
        h = self.post_attention_layernorm(self.self_attn(residual, rope, meta, kv, prepared, keep_rows), prepared)
        if keep_rows is not None:
            residual = residual[keep_rows]
        residual = residual + h
        return self.post_feedforward_layernorm(self.mlp(residual, prepared), prepared), residual


class Olmo2Model(LlamaModel):
    def decoder_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        return Olmo2DecoderLayer(cfg, layer)

    def decode_stack_spec(self, linears: Mapping[nn.Module, Weight]) -> tuple[list[StackLayer], StackShape] | None:
        return None
