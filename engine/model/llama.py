"""A Llama-family decoder (Llama 2/3, SmolLM, Qwen2, Mistral) written for a paged KV cache.

forward() takes the flat batch of new tokens of every scheduled sequence (no padding) with their positions
and the attention metadata; each layer writes its new keys/values into the cache pages and attends through
them. Projections are fused (q|k|v and gate|up) so that one step issues few, large matrix products.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, paged_attention
from engine.config import ModelConfig
from engine.kernels import cpu_ext, packed_linear
from engine.model.rope import RotaryEmbedding, apply_rotary

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [T, 1, head_dim / 2]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, use_kernels: bool,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or with the kernels on (bf16 on the CPU): the weight's packed copy (16x16-pair blocks or oneDNN's) for
    products within its row limit (packed_linear.max_rows), the streaming GEMV for a row (for a few rows when
    there is no packed copy)."""
    if use_kernels:
        if packed is not None and packed_linear.applies(x, packed):
            return packed_linear.linear(x, packed, bias)
        if cpu_ext.applies(x, weight):
            return cpu_ext.linear_bf16(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear that uses the packed weight or the GEMV kernel where they apply once the model's kernels are
    switched on (LlamaModel.use_kernels)."""

    use_kernels = False  # set per instance by LlamaModel.use_kernels
    packed: torch.Tensor | None = None  # oneDNN-packed copy of the weight, made by LlamaModel.use_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.use_kernels, self.packed)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as the reference implementation does."""

    use_kernels = False  # set per instance by LlamaModel.use_kernels

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_kernels and cpu_ext.elementwise_applies(x):
            return cpu_ext.rms_norm(x, self.weight, self.eps)[0]
        return self._norm(x)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the residual add, fused into the norm when the kernels are on."""
        if self.use_kernels and cpu_ext.elementwise_applies(x):
            return cpu_ext.rms_norm(x, self.weight, self.eps, residual)
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    use_kernels = False  # set per instance by LlamaModel.use_kernels

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.attention_out_bias)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, rope: Rope, meta: AttentionMetadata,
                kv: tuple[torch.Tensor, torch.Tensor], keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """-> [T, hidden], or [len(keep_rows), hidden]: the output projection of those rows only (every row's
        keys and values are written all the same)."""
        c = self.cfg
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        rotate_in_place = self.use_kernels and cpu_ext.elementwise_applies(qkv)
        if rotate_in_place:
            cpu_ext.rotary_(qkv, *rope, c.num_heads + c.num_kv_heads, c.head_dim)  # the q and k heads
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)  # [T, *]
        q = q.view(-1, c.num_heads, c.head_dim)
        k = k.view(-1, c.num_kv_heads, c.head_dim)
        v = v.view(-1, c.num_kv_heads, c.head_dim)
        if not rotate_in_place:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        out = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale)  # [T, Hq, hd]
        if keep_rows is not None:
            out = out[keep_rows]  # [K, Hq, hd]
        return self.o_proj(out.reshape(len(out), c.q_size))


class MLP(nn.Module):
    use_kernels = False  # set per instance by LlamaModel.use_kernels
    # gate|up packed with its blocks interleaved for the fused product (packed_linear.pack_gate_up), made by
    # LlamaModel.use_kernels; gate_up_proj then keeps no packed copy of its own
    gate_up_silu: torch.Tensor | None = None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_silu is not None and packed_linear.gate_up_applies(x):
            return self.down_proj(cpu_ext.tiled_linear_silu_mul(x, self.gate_up_silu))  # silu(gate) * up [T, I]
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate]
        if self.use_kernels and cpu_ext.elementwise_applies(gate_up):
            return self.down_proj(cpu_ext.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, meta: AttentionMetadata,
                kv: tuple[torch.Tensor, torch.Tensor],
                keep_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, not yet added to the residual stream (None before the first layer)
        -> this layer's output and the stream: each add happens inside the norm that follows it. With
        `keep_rows`, everything after attention runs on those rows only (they are all a last layer must give)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, rope, meta, kv, keep_rows)
        if keep_rows is not None:
            residual = residual[keep_rows]
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    """Decoder stack plus LM head. KV pages are passed in, never owned, so actors can share or export them."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.cfg = cfg
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                                    device)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.kernels_on = False  # see use_kernels
        self.lm_packed: torch.Tensor | None = None  # oneDNN-packed LM head, see use_kernels
        self.stack = None  # the layers as one C++ call for decode-only steps (cpu_ext DecodeStack), see use_kernels

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_layers: int | None = None,
                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]; after the first `num_layers` layers
        only when given (a self-draft: the final norm still applies). With `keep_rows` [K] (the rows the
        caller reads, e.g. the sampled ones) -> [K, hidden] for those rows, in that order: the last layer
        then runs its output projection and MLP on them only, which in a prefill step of whole prompts
        skips nearly all of that layer's products. A decode-only step with the kernels on runs the layers
        as one C++ call (_stack_applies), to the same bits."""
        x = self.embed_tokens(input_ids)
        rope = self.rope.lookup(positions, x.dtype)
        kv_caches = kv_caches[:len(self.layers) if num_layers is None else num_layers]
        if self._stack_applies(x, meta, kv_caches):
            x, residual = self._run_stack(x, rope, meta, kv_caches)
            if keep_rows is not None:
                x, residual = x[keep_rows], residual[keep_rows]
        else:
            residual = None
            last = len(kv_caches) - 1
            for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
                x, residual = layer(x, residual, rope, meta, kv, keep_rows if i == last else None)
        return self.norm.add_forward(x, residual)[0]

    def _stack_applies(self, x: torch.Tensor, meta: AttentionMetadata,
                       kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether the C++ stack computes exactly what the layers would: kernels on, a decode-only step (one
        token a row, all in the group of the decode-attention kernel), bf16 activations the fused kernels take,
        plain bf16 pages (no quantised or tiered caches) in every layer that runs."""
        return (self.stack is not None and cpu_ext.DECODE_STACK and len(kv_caches) > 0
                and meta.use_kernels and not meta.prefills and 0 < meta.num_decode == x.shape[0]
                and cpu_ext.attention_applies(meta.num_decode_seqs) and cpu_ext.elementwise_applies(x)
                and all(_plain_bf16_pages(k) and _plain_bf16_pages(v) for k, v in kv_caches))

    def _run_stack(self, x: torch.Tensor, rope: Rope, meta: AttentionMetadata,
                   kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers of a decode-only step in one call -> (last layer's output, residual stream)."""
        return self.stack.forward(x, *rope, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens,
                                  kv_caches, cpu_ext.MAX_GEMV_ROWS, packed_linear.MAX_PACKED_ROWS,
                                  packed_linear.max_tiled_rows())

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """hidden [B, hidden] -> logits [B, vocab], in float32 or (float32=False) in the model's dtype."""
        logits = linear(hidden, self._lm_weight(), None, self.kernels_on, self.lm_packed)
        return logits.float() if float32 else logits

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [B, hidden] -> [B] int64: each row's argmax of compute_logits(hidden, float32=False), taken as
        the packed LM head's results come out, without the [B, V] logits. None where that path does not apply
        (kernels off, an LM head not packed in blocks, a row count the packed product does not take)."""
        if self.lm_packed is None or self.lm_packed.dim() != 4 or not packed_linear.applies(hidden, self.lm_packed):
            return None
        return cpu_ext.tiled_linear_argmax(hidden, self.lm_packed)

    def _lm_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def use_kernels(self, on: bool = True) -> None:
        """Switch the CPU kernels (oneDNN-packed weights, one-row GEMV, fused RMSNorm / RoPE / SiLU*up here,
        in-place decode attention via the runner) on or off; off is plain torch ops everywhere. Builds them now
        (once per machine), not on the first request; stays off where they cannot be built. Call it after the
        weights are loaded: the packed copies are taken here."""
        self.kernels_on = on and cpu_ext.available()
        for layer in self.layers:
            mlp = layer.mlp
            mlp.gate_up_silu = packed_linear.pack_gate_up(mlp.gate_up_proj.weight) if self.kernels_on else None
        # a gate|up product with the fused copy packs none of its own: 2+ rows take that copy, one row the GEMV
        fused = {layer.mlp.gate_up_proj for layer in self.layers if layer.mlp.gate_up_silu is not None}
        for module in self.modules():
            if isinstance(module, (Linear, RMSNorm, Attention, MLP)):
                module.use_kernels = self.kernels_on
            if isinstance(module, Linear):
                module.packed = packed_linear.pack(module.weight) if self.kernels_on and module not in fused else None
        self.lm_packed = packed_linear.pack(self._lm_weight()) if self.kernels_on else None
        self.stack = self._build_stack() if self.kernels_on else None

    def _build_stack(self) -> object:
        """The C++ decode stack holding every layer's weights (and packed copies): built once, so that a step
        passes only its own tensors."""
        c = self.cfg
        stack = cpu_ext.extension().DecodeStack(c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps,
                                                self.layers[0].self_attn.scale)
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            stack.add_layer(layer.input_layernorm.weight, _projection(attn.qkv_proj), _projection(attn.o_proj),
                            layer.post_attention_layernorm.weight, _projection(mlp.gate_up_proj),
                            _projection(mlp.down_proj), mlp.gate_up_silu)
        return stack

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up; every parameter must be filled."""
        params = dict(self.named_parameters())
        rows_filled = dict.fromkeys(params, 0)
        for name, tensor in weights:
            target, offset = self._fused_target(name)
            if target is None:
                continue
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
            params[target].narrow(0, offset, tensor.shape[0]).copy_(tensor)
            rows_filled[target] += tensor.shape[0]
        missing = sorted(n for n, rows in rows_filled.items() if rows != params[n].shape[0])
        if missing:
            raise KeyError(f"checkpoint lacks or mis-sizes {len(missing)} tensors, e.g. {missing[:3]}")

    def _fused_target(self, name: str) -> tuple[str | None, int]:
        c = self.cfg
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.lm_head is None):
            return None, 0
        name = name.removeprefix("model.")
        fused = {
            "self_attn.q_proj": ("self_attn.qkv_proj", 0),
            "self_attn.k_proj": ("self_attn.qkv_proj", c.q_size),
            "self_attn.v_proj": ("self_attn.qkv_proj", c.q_size + c.kv_size),
            "mlp.gate_proj": ("mlp.gate_up_proj", 0),
            "mlp.up_proj": ("mlp.gate_up_proj", c.intermediate_size),
        }
        for part, (fused_part, offset) in fused.items():
            if f".{part}." in name:
                return name.replace(part, fused_part), offset
        return name, 0


def _projection(linear: Linear) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    return linear.weight, linear.bias, linear.packed


def _plain_bf16_pages(cache: object) -> bool:
    return isinstance(cache, torch.Tensor) and cache.dtype == torch.bfloat16 and cache.is_cpu


def build_model(cfg: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                device: torch.device | str = "cpu") -> LlamaModel:
    """Allocate the model uninitialised (meta device), then fill it from the checkpoint in `dtype`."""
    with torch.device("meta"):
        model = LlamaModel(cfg, device)
    model = model.to_empty(device=device).to(dtype)
    model.load_weights(weights)
    return model.eval().requires_grad_(False)
