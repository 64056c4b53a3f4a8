"""A Llama-family decoder (Llama 2/3, SmolLM, Qwen2, Qwen3, Mistral) or Gemma 2/3, written for a paged KV cache.

forward() takes the flat batch of new tokens of every scheduled sequence (no padding) with their positions
and the attention metadata; each layer writes its new keys/values into the cache pages and attends through
them. Projections are fused (q|k|v and gate|up) so that one step issues few, large matrix products.

Gemma differs only in what ModelConfig names: embeddings scaled by sqrt(hidden); RMSNorm weights stored as w
and applied as (1 + w), so they are loaded as 1 + w and every norm runs as Llama's; GeGLU; a norm after
attention and after the MLP as well as before each (GemmaDecoderLayer); soft-capped attention scores and
logits; windowed layers with their own RoPE base (Gemma 3).
"""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.backends.attention import AttentionMetadata, paged_attention
from engine.backends.base import Backend, Rope
from engine.backends.torch_ops import TorchBackend
from engine.config import ModelConfig
from engine.model import quant
from engine.model.rope import RotaryEmbedding


class Linear(nn.Linear):
    """nn.Linear whose product the backend runs, on the weight's packed copy where the backend made one; with
    `weight_scale` the weight is int8 codes with per-output-channel scales, or int4 codes with group scales
    (engine/model/quant.py)."""

    packed: torch.Tensor | None = None  # the backend's packed copy of the weight (Backend.prepare)
    # [out_features] fp32 where the weight is int8; [2, groups, out_features] fp16 where it is int4
    weight_scale: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, backend: Backend) -> torch.Tensor:
        if self.weight_scale is not None:
            return quantized_linear(backend, x, self.weight, self.weight_scale, self.bias)
        return backend.linear(x, self.weight, self.bias, self.packed)


def quantized_linear(backend: Backend, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """The backend's product on an int8 or int4 weight (quant.is_int4 tells them apart)."""
    if quant.is_int4(weight):
        return backend.linear_int4(x, weight, scale, bias)
    return backend.linear_int8(x, weight, scale, bias)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as the reference implementation does."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, backend: Backend) -> torch.Tensor:
        return backend.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor,
                    backend: Backend) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the residual add, fused into the norm where the backend can."""
        return backend.add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.window = cfg.layer_window(layer)  # None: the layer attends to its whole context
        self.softcap = cfg.attn_logit_softcap
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.attention_out_bias)
        # Qwen3: one RMSNorm over head_dim, shared by every q head (and one by every k head)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.attention_scale

    def forward(self, x: torch.Tensor, rope: Rope, meta: AttentionMetadata, kv: tuple[torch.Tensor, torch.Tensor],
                backend: Backend, keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """-> [T, hidden], or [len(keep_rows), hidden]: the output projection of those rows only (every row's
        keys and values are written all the same)."""
        c = self.cfg
        qkv = self.qkv_proj(x, backend)  # [T, q_size + 2 * kv_size]
        if self.q_norm is not None:
            self._norm_heads(qkv, backend)
        q, k, v = backend.rotary(qkv, rope, c.num_heads, c.num_kv_heads, c.head_dim)  # [T, H, hd]
        out = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale, backend, self.window,
                              self.softcap)  # [T, Hq, hd]
        if keep_rows is not None:
            out = out[keep_rows]  # [K, Hq, hd]
        return self.o_proj(out.reshape(len(out), c.q_size), backend)

    def _norm_heads(self, qkv: torch.Tensor, backend: Backend) -> None:
        """Normalises each q head and each k head of qkv [T, q_size + 2 * kv_size] over head_dim, in place, so
        that rotary and attention keep reading the fused layout they take."""
        c = self.cfg
        for norm, start, size in ((self.q_norm, 0, c.q_size), (self.k_norm, c.q_size, c.kv_size)):
            part = qkv[:, start:start + size]  # [T, H * hd], rows strided by the fused width
            heads = part.reshape(-1, c.head_dim)  # [T * H, hd], a contiguous copy
            part.copy_(norm(heads, backend).view(part.shape))


class MLP(nn.Module):
    # gate|up packed with its blocks interleaved for the fused product (Backend.prepare); gate_up_proj then
    # keeps no packed copy of its own
    gate_up_silu: torch.Tensor | None = None

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = cfg.hidden_act

    def forward(self, x: torch.Tensor, backend: Backend) -> torch.Tensor:
        gate_up = self.gate_up_proj
        if self.act == "gelu_tanh":  # GeGLU: gelu_tanh(gate) * up [T, I]
            gate, up = gate_up(x, backend).chunk(2, dim=-1)
            h = F.gelu(gate, approximate="tanh") * up
        elif gate_up.weight_scale is not None:  # int8 or int4: no packed or fused copy
            h = backend.silu_mul(gate_up(x, backend))
        else:
            h = backend.gate_up_silu(x, gate_up.weight, gate_up.packed, self.gate_up_silu)  # silu(gate) * up [T, I]
        return self.down_proj(h, backend)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, meta: AttentionMetadata,
                kv: tuple[torch.Tensor, torch.Tensor], backend: Backend,
                keep_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, not yet added to the residual stream (None before the first layer)
        -> this layer's output and the stream: each add happens inside the norm that follows it. With
        `keep_rows`, everything after attention runs on those rows only (they are all a last layer must give)."""
        if residual is None:
            h, residual = self.input_layernorm(x, backend), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual, backend)
        h = self.self_attn(h, rope, meta, kv, backend, keep_rows)
        if keep_rows is not None:
            residual = residual[keep_rows]
        h, residual = self.post_attention_layernorm.add_forward(h, residual, backend)
        return self.mlp(h, backend), residual


class GemmaDecoderLayer(nn.Module):
    """Gemma 2/3: each sub-block's output is normalised before it joins the residual stream, and the MLP's input
    has a norm of its own (post_attention_layernorm here follows attention, unlike Llama's)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, meta: AttentionMetadata,
                kv: tuple[torch.Tensor, torch.Tensor], backend: Backend,
                keep_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As DecoderLayer.forward: x is the previous layer's normalised MLP output, not yet added."""
        if residual is None:
            h, residual = self.input_layernorm(x, backend), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual, backend)
        h = self.post_attention_layernorm(self.self_attn(h, rope, meta, kv, backend, keep_rows), backend)
        if keep_rows is not None:
            residual = residual[keep_rows]
        h, residual = self.pre_feedforward_layernorm.add_forward(h, residual, backend)
        return self.post_feedforward_layernorm(self.mlp(h, backend), backend), residual


class LlamaModel(nn.Module):
    """Decoder stack plus LM head. KV pages are passed in, never owned, so actors can share or export them."""

    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.cfg = cfg
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                                    device)
        # Gemma 3's windowed layers rotate with their own base, unscaled
        self.local_rope = None if cfg.rope_local_theta is None else RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_local_theta, None, device)
        # Given its (meta) weight, Embedding skips its random init, whose meta-device path imports torch._dynamo
        # (about 1.5 s of every actor start).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        layer_class = GemmaDecoderLayer if cfg.sandwich_norms else DecoderLayer
        self.layers = nn.ModuleList(layer_class(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.backend: Backend = TorchBackend(device)  # see set_backend
        self.lm_packed: torch.Tensor | None = None  # the backend's packed copy of the LM head
        self.stack: object | None = None  # the backend's decode stack: the layers as one call (decode-only steps)
        # Called with a layer's index once its KV is in the cache, in the layer-by-layer path only (a prefill
        # actor streams that layer's pages to another host while the next one computes).
        self.layer_hook: Callable[[int], None] | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], num_layers: int | None = None,
                keep_rows: torch.Tensor | None = None,
                layer_metas: Sequence[AttentionMetadata] | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]; after the first `num_layers` layers
        only when given (a self-draft: the final norm still applies). With `keep_rows` [K] (the rows the
        caller reads, e.g. the sampled ones) -> [K, hidden] for those rows, in that order: the last layer
        then runs its output projection and MLP on them only, which in a prefill step of whole prompts
        skips nearly all of that layer's products. A decode-only step may run the layers as one backend call
        (Backend.decode_layers), to the same bits. `layer_metas`: per layer, its own metadata (KV-cache groups,
        engine/kv/groups.py: each group's block tables differ), instead of `meta` for every layer; the layers
        then run one by one."""
        x = self.embed(input_ids)
        if self.cfg.scale_embeddings:  # the scale rounded to the weights' dtype first, as transformers does
            x = x * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=x.dtype)
        rope = self.rope.lookup(positions, x.dtype)
        local = rope if self.local_rope is None else self.local_rope.lookup(positions, x.dtype)
        kv_caches = kv_caches[:len(self.layers) if num_layers is None else num_layers]
        stacked = None if layer_metas is not None else self.backend.decode_layers(self, x, rope, meta, kv_caches)
        if stacked is not None:
            x, residual = stacked
            if keep_rows is not None:
                x, residual = x[keep_rows], residual[keep_rows]
        else:
            residual = None
            last = len(kv_caches) - 1
            for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
                layer_rope = rope if layer.self_attn.window is None else local
                layer_meta = meta if layer_metas is None else layer_metas[i]
                x, residual = layer(x, residual, layer_rope, layer_meta, kv, self.backend,
                                    keep_rows if i == last else None)
                if self.layer_hook is not None:
                    self.layer_hook(i)
        return self.norm.add_forward(x, residual, self.backend)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, hidden] -> logits [B, vocab] in float32 (Backend.lm_head), soft-capped where the model is."""
        logits = self.backend.lm_head(hidden, self.lm_weight(), self.lm_scale(), self.lm_packed)
        cap = self.cfg.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [B, hidden] -> [B] int64: each row's argmax of compute_logits(hidden), taken as the LM head's
        results come out, without the [B, V] logits; None where the backend has no such path, and with capped
        logits (tanh may tie what the raw logits order)."""
        if self.cfg.final_logit_softcap is not None:
            return None
        return self.backend.greedy_tokens(self, hidden)

    def lm_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def lm_scale(self) -> torch.Tensor | None:
        """The LM head's scales where its weight is int8 or int4, else None."""
        return getattr(self.embed_tokens if self.lm_head is None else self.lm_head, "weight_scale", None)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> embeddings [T, hidden] in the model's dtype (dequantised rows of a quantised table)."""
        scale = getattr(self.embed_tokens, "weight_scale", None)
        if scale is None:
            return self.embed_tokens(input_ids)
        if quant.is_int4(self.embed_tokens.weight):
            return quant.embed_int4(self.embed_tokens.weight, scale, input_ids, self.cfg.hidden_size, self.dtype)
        return quant.embed_int8(self.embed_tokens.weight, scale, input_ids, self.dtype)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' (and the plain weights') dtype: the norms', which are never quantised."""
        return self.norm.weight.dtype

    @property
    def weight_dtype(self) -> str:
        """"int8" / "int4" where the layers' projections hold such codes (engine/model/quant.py), else the dtype's
        name."""
        proj = self.layers[0].self_attn.qkv_proj if len(self.layers) else None
        if proj is not None and proj.weight_scale is not None:
            return "int4" if quant.is_int4(proj.weight) else "int8"
        return str(self.dtype).removeprefix("torch.")

    def set_backend(self, backend: Backend) -> None:
        """Run on `backend` from now on; it prepares what it needs of the weights now (packed copies, the decode
        stack), so call this after the weights are loaded."""
        backend.prepare(self)
        self.backend = backend

    def clear_prepared(self) -> None:
        """Drop every copy a backend made of the weights."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.packed = None
            if isinstance(module, MLP):
                module.gate_up_silu = None
        self.lm_packed = None
        self.stack = None

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up; every parameter must be filled."""
        params = dict(self.named_parameters())
        scales = quant.weight_scales(self)  # quantised weights: each tensor's rows quantised as they arrive
        rows_filled = dict.fromkeys(params, 0)
        rows_needed = {n: scales[n].shape[-1] if n in scales else p.shape[0] for n, p in params.items()}
        for name, tensor in weights:
            target, offset = self._fused_target(name)
            if target is None:
                continue
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
            if self.cfg.norm_weight_offset and target.endswith("norm.weight"):  # Gemma's (1 + w), in float32
                # in place on the float copy: out of place, a meta tensor (check_model) imports torch._dynamo
                tensor = tensor.to(torch.float32, copy=True).add_(self.cfg.norm_weight_offset)
            if target in scales and quant.is_int4(params[target]):
                quant.store_int4(params[target], scales[target], offset, tensor)
            elif target in scales:
                codes, scale = quant.quantize_rows(tensor)
                params[target].narrow(0, offset, tensor.shape[0]).copy_(codes)
                scales[target].narrow(0, offset, tensor.shape[0]).copy_(scale)
            else:
                params[target].narrow(0, offset, tensor.shape[0]).copy_(tensor)
            rows_filled[target] += tensor.shape[0]
        missing = sorted(n for n, rows in rows_filled.items() if rows != rows_needed[n])
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


def build_model(cfg: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                device: torch.device | str = "cpu", weight_dtype: str | quant.WeightChoice = "bfloat16") -> LlamaModel:
    """Allocate the model uninitialised (meta device), then fill it from the checkpoint in `dtype`; with
    weight_dtype "int8" or "int4" the projections and LM head are quantised as they load (engine/model/quant.py),
    or as a WeightChoice names for each ("auto" here is bfloat16: the loader resolves it from the file first,
    quant.choose_weight_dtype)."""
    with torch.device("meta"):
        model = LlamaModel(cfg, device)
    if isinstance(weight_dtype, str):
        chosen = quant.resolve_weight_dtype(weight_dtype)
        weight_dtype = quant.WeightChoice(chosen, chosen)
    quant.apply_layout(model, weight_dtype, device)
    _materialise(model, dtype, device)
    model.load_weights(weights)
    return model.eval().requires_grad_(False)


def _materialise(model: nn.Module, dtype: torch.dtype, device: torch.device | str) -> None:
    """Real, uninitialised storage for every meta parameter and buffer (floating ones in `dtype`). Plain
    torch.empty: Module.to_empty goes through the meta tensors' Python reference ops, whose first call
    imports sympy and torch.fx (about 0.8 s of every actor start)."""
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is None or tensor.device.type != "meta":
                    continue
                empty = torch.empty(tensor.shape, dtype=dtype if tensor.is_floating_point() else tensor.dtype,
                                    device=device)
                table[name] = nn.Parameter(empty, requires_grad=False) if name in module._parameters else empty
