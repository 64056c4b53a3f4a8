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

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.backends import weight_ops
from engine.backends.attention import AttentionMetadata, paged_attention
from engine.backends.base import Backend, Rope, StackLayer, StackShape
from engine.backends.torch_ops import TorchBackend
from engine.backends.weight_ops import Weight
from engine.config import ModelConfig
from engine.model import quant
from engine.model.layers import Linear, PreparedWeights, RMSNorm, SiluGateUp, prepare_weights
from engine.model.rope import RotaryEmbedding


# checkpoint projections -> the fused projection they fill (q|k|v, gate|up): one product each
FUSED_PARTS = {"self_attn.q_proj": "self_attn.qkv_proj", "self_attn.k_proj": "self_attn.qkv_proj",
               "self_attn.v_proj": "self_attn.qkv_proj", "mlp.gate_proj": "mlp.gate_up_proj",
               "mlp.up_proj": "mlp.gate_up_proj"}


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
                prepared: PreparedWeights, keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """-> [T, hidden], or [len(keep_rows), hidden]: the output projection of those rows only (every row's
        keys and values are written all the same)."""
        c = self.cfg
        qkv = self.qkv_proj(x, prepared)  # [T, q_size + 2 * kv_size]
        if self.q_norm is not None:
            self._norm_qk(qkv, prepared)
        q, k, v = prepared.backend.rotary(qkv, rope, c.num_heads, c.num_kv_heads, c.head_dim)  # [T, H, hd]
        out = paged_attention(q, k, v, kv[0], kv[1], meta, self.scale, prepared.backend, self.window,
                              self.softcap)  # [T, Hq, hd]
        if keep_rows is not None:
            out = out[keep_rows]  # [K, Hq, hd]
        return self.o_proj(out.reshape(len(out), c.q_size), prepared)

    def _norm_qk(self, qkv: torch.Tensor, prepared: PreparedWeights) -> None:
        """Normalises each q head and each k head of qkv [T, q_size + 2 * kv_size] over head_dim, in place, so
        that rotary and attention keep reading the fused layout they take."""
        c = self.cfg
        for norm, start, size in ((self.q_norm, 0, c.q_size), (self.k_norm, c.q_size, c.kv_size)):
            part = qkv[:, start:start + size]  # [T, H * hd], rows strided by the fused width
            heads = part.reshape(-1, c.head_dim)  # [T * H, hd], a contiguous copy
            part.copy_(norm(heads, prepared).view(part.shape))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        gate_up = SiluGateUp if cfg.hidden_act == "silu" else Linear  # SiluGateUp: silu(gate) * up [T, I]
        self.gate_up_proj = gate_up(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = cfg.hidden_act

    def forward(self, x: torch.Tensor, prepared: PreparedWeights) -> torch.Tensor:
        if self.act == "gelu_tanh":  # GeGLU: gelu_tanh(gate) * up [T, I]
            gate, up = self.gate_up_proj(x, prepared).chunk(2, dim=-1)
            h = F.gelu(gate, approximate="tanh") * up
        else:
            h = self.gate_up_proj(x, prepared)
        return self.down_proj(h, prepared)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: Rope, meta: AttentionMetadata,
                kv: tuple[torch.Tensor, torch.Tensor], prepared: PreparedWeights,
                keep_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, not yet added to the residual stream (None before the first layer)
        -> this layer's output and the stream: each add happens inside the norm that follows it. With
        `keep_rows`, everything after attention runs on those rows only (they are all a last layer must give)."""
        if residual is None:
            h, residual = self.input_layernorm(x, prepared), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual, prepared)
        h = self.self_attn(h, rope, meta, kv, prepared, keep_rows)
        if keep_rows is not None:
            residual = residual[keep_rows]
        h, residual = self.post_attention_layernorm.add_forward(h, residual, prepared)
        return self.mlp(h, prepared), residual


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
                kv: tuple[torch.Tensor, torch.Tensor], prepared: PreparedWeights,
                keep_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """As DecoderLayer.forward: x is the previous layer's normalised MLP output, not yet added."""
        if residual is None:
            h, residual = self.input_layernorm(x, prepared), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual, prepared)
        h = self.post_attention_layernorm(self.self_attn(h, rope, meta, kv, prepared, keep_rows), prepared)
        if keep_rows is not None:
            residual = residual[keep_rows]
        h, residual = self.pre_feedforward_layernorm.add_forward(h, residual, prepared)
        return self.post_feedforward_layernorm(self.mlp(h, prepared), prepared), residual


@dataclass
class LayerPass:
    """A forward part-way through the layers: the rows after layer `next_layer - 1` (LlamaModel.run_layers)."""

    x: torch.Tensor  # [T, hidden]
    residual: torch.Tensor | None
    rope: Rope
    local: Rope  # the rotation of windowed layers (the same as `rope` where the model has one)
    next_layer: int = 0


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
        self.layers = nn.ModuleList(self.decoder_layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.prepared: PreparedWeights | None = None  # the weights in the backend's layout (set_backend)
        # Called with a layer's index once its KV is in the cache, in the layer-by-layer path only (a prefill
        # actor streams that layer's pages to another host while the next one computes).
        self.layer_hook: Callable[[int], None] | None = None

    def decoder_layer(self, cfg: ModelConfig, layer: int) -> nn.Module:
        """Layer `layer` of the stack; an architecture whose layers differ overrides this (engine/model/olmo2.py)."""
        return GemmaDecoderLayer(cfg, layer) if cfg.sandwich_norms else DecoderLayer(cfg, layer)

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
        prepared = self.prepared
        state = self.begin_layers(input_ids, positions)
        kv_caches = kv_caches[:len(self.layers) if num_layers is None else num_layers]
        window = self.cfg.sliding_window if self.cfg.windowed else None
        stacked = None if layer_metas is not None else prepared.decode_layers(state.x, state.rope, meta, kv_caches,
                                                                              window)
        if stacked is not None:
            x, residual = stacked
            if keep_rows is not None:
                x, residual = x[keep_rows], residual[keep_rows]
            return self.norm.add_forward(x, residual, prepared)[0]
        self.run_layers(state, meta, kv_caches, len(kv_caches), keep_rows, layer_metas)
        return self.end_layers(state)

    def begin_layers(self, input_ids: torch.Tensor, positions: torch.Tensor) -> LayerPass:
        """A forward to run layer by layer (run_layers, then end_layers): the embedded rows and their rotations."""
        x = self.embed(input_ids)
        if self.cfg.scale_embeddings:  # the scale rounded to the weights' dtype first, as transformers does
            x = x * torch.tensor(self.cfg.hidden_size ** 0.5, dtype=x.dtype)
        rope = self.rope.lookup(positions, x.dtype)
        local = rope if self.local_rope is None else self.local_rope.lookup(positions, x.dtype)
        return LayerPass(x, None, rope, local)

    def run_layers(self, state: LayerPass, meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                   count: int, keep_rows: torch.Tensor | None = None,
                   layer_metas: Sequence[AttentionMetadata] | None = None) -> None:
        """The next `count` layers of `state` (at most those left of `kv_caches`' layers); the last layer of all
        runs its output projection and MLP on `keep_rows` only, where given."""
        last = len(kv_caches) - 1
        for i in range(state.next_layer, min(state.next_layer + count, len(kv_caches))):
            layer = self.layers[i]
            layer_rope = state.rope if layer.self_attn.window is None else state.local
            layer_meta = meta if layer_metas is None else layer_metas[i]
            state.x, state.residual = layer(state.x, state.residual, layer_rope, layer_meta, kv_caches[i],
                                            self.prepared, keep_rows if i == last else None)
            state.next_layer = i + 1
            if self.layer_hook is not None:
                self.layer_hook(i)

    def end_layers(self, state: LayerPass) -> torch.Tensor:
        """The final norm over what the layers left: the hidden states forward() returns."""
        return self.norm.add_forward(state.x, state.residual, self.prepared)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, hidden] -> logits [B, vocab] in float32 (Backend.lm_head), soft-capped where the model is."""
        logits = self.prepared.lm_head(hidden)
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
        return self.prepared.greedy_tokens(hidden)

    def head_module(self) -> nn.Module:
        """The LM head's module: the embedding table where they are tied."""
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def lm_scale(self) -> torch.Tensor | None:
        """The LM head's scales where its weight is int8 or int4, else None."""
        return getattr(self.head_module(), "weight_scale", None)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> embeddings [T, hidden] in the model's dtype (dequantised rows of a quantised table)."""
        scale = getattr(self.embed_tokens, "weight_scale", None)
        if scale is None:
            return self.embed_tokens(input_ids)
        if weight_ops.is_int4(self.embed_tokens.weight):
            return weight_ops.embed_int4(self.embed_tokens.weight, scale, input_ids, self.cfg.hidden_size, self.dtype)
        if weight_ops.is_int8g(self.embed_tokens.weight, scale):
            return weight_ops.embed_int8g(self.embed_tokens.weight, scale, input_ids, self.cfg.hidden_size,
                                          self.dtype)
        return weight_ops.embed_int8(self.embed_tokens.weight, scale, input_ids, self.dtype)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' (and the plain weights') dtype: the norms', which are never quantised."""
        return self.norm.weight.dtype

    @property
    def weight_dtype(self) -> str:
        """"int8" / "int4" where the layers' projections hold such codes (engine/model/quant.py), else the dtype's
        name; the formats joined by "+" (in layer order) where the projections' differ (`auto` on a GGUF file of
        mixed tensor types)."""
        formats = dict.fromkeys(self._format(module) for module in self.modules() if isinstance(module, Linear))
        return "+".join(formats) or str(self.dtype).removeprefix("torch.")

    def _format(self, module: Linear) -> str:
        if module.weight_scale is not None:
            return weight_ops.weight_format(module.weight, module.weight_scale)
        return str(self.dtype).removeprefix("torch.")

    @property
    def backend(self) -> Backend:
        return self.prepared.backend

    def set_backend(self, backend: Backend) -> None:
        """Run on `backend` from now on; it prepares what it needs of the weights now (packed copies, the decode
        stack; engine/model/layers.py prepare_weights), so call this after the weights are loaded. The copies an
        earlier backend made are dropped first."""
        self.prepared = None
        self.prepared = prepare_weights(self, backend)

    def decode_stack_spec(self, linears: Mapping[nn.Module, Weight]) -> tuple[list[StackLayer], StackShape] | None:
        """The layers as a fused decode step computes them: Llama's layer (SiLU MLP, one RoPE, uncapped scores); a
        sliding window only while every context lies within it (Backend.decode_layers checks)."""
        c = self.cfg
        if (c.sandwich_norms or c.hidden_act != "silu" or c.attn_logit_softcap is not None
                or c.rope_local_theta is not None):
            return None
        layers = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            layers.append(StackLayer(layer.input_layernorm.weight, linears[attn.qkv_proj], linears[attn.o_proj],
                                     layer.post_attention_layernorm.weight, linears[mlp.gate_up_proj],
                                     linears[mlp.down_proj], _norm_weight(attn.q_norm), _norm_weight(attn.k_norm)))
        shape = StackShape(c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps, c.attention_scale)
        return layers, shape

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | quant.FileBlocks]]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up; every parameter must be filled."""
        params = dict(self.named_parameters())
        scales = quant.weight_scales(self)  # quantised weights: each tensor's rows quantised as they arrive
        rows_filled = dict.fromkeys(params, 0)
        rows_needed = {n: weight_ops.output_channels(p, scales.get(n)) for n, p in params.items()}
        for name, tensor in weights:
            target, offset = self._fused_target(name)
            if target is None:
                continue
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
            self._store(params[target], scales.get(target), offset, target, tensor)
            rows_filled[target] += tensor.shape[0]
        missing = sorted(n for n, rows in rows_filled.items() if rows != rows_needed[n])
        if missing:
            raise KeyError(f"checkpoint lacks or mis-sizes {len(missing)} tensors, e.g. {missing[:3]}")
        quant.compact_int8g_scales(self)

    def _store(self, param: torch.Tensor, scale: torch.Tensor | None, offset: int, target: str,
               tensor: torch.Tensor | quant.FileBlocks) -> None:
        """One checkpoint tensor into its rows of a parameter: int4 takes FileBlocks as they are (and quantises a
        float tensor), int8g takes FileBlocks as they are, int8 quantises the float values, a plain parameter
        copies them."""
        if scale is not None and weight_ops.is_int4(param):
            quant.store_int4(param, scale, offset, tensor)
            return
        if weight_ops.is_int8g(param, scale):
            quant.store_int8g(param, scale, offset, tensor)
            return
        tensor = quant.float_values(tensor)
        if self.cfg.norm_weight_offset and target.endswith("norm.weight"):  # Gemma's (1 + w), in float32
            # in place on the float copy: out of place, a meta tensor (check_model) imports torch._dynamo
            tensor = tensor.to(torch.float32, copy=True).add_(self.cfg.norm_weight_offset)
        if scale is not None:
            codes, row_scales = quant.quantize_rows(tensor)
            param.narrow(0, offset, tensor.shape[0]).copy_(codes)
            scale.narrow(0, offset, tensor.shape[0]).copy_(row_scales)
        else:
            param.narrow(0, offset, tensor.shape[0]).copy_(tensor)

    @staticmethod
    def parameter_name(name: str) -> str:
        """The parameter a Hugging Face-named checkpoint tensor fills: q/k/v go into qkv_proj and gate/up into
        gate_up_proj (without the "model." prefix)."""
        name = name.removeprefix("model.")
        for part, fused_part in FUSED_PARTS.items():
            if f".{part}." in name:
                return name.replace(part, fused_part)
        return name

    def _fused_target(self, name: str) -> tuple[str | None, int]:
        """(the parameter a checkpoint tensor fills, its first row there), or (None, 0) for a tensor left out."""
        c = self.cfg
        if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.lm_head is None):
            return None, 0
        offsets = {"self_attn.k_proj": c.q_size, "self_attn.v_proj": c.q_size + c.kv_size,
                   "mlp.up_proj": c.intermediate_size}
        return self.parameter_name(name), next((o for part, o in offsets.items() if f".{part}." in name), 0)


def build_model(cfg: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                device: torch.device | str = "cpu", weight_dtype: str | quant.WeightChoice = "bfloat16",
                model_class: type[LlamaModel] | None = None) -> LlamaModel:
    """Allocate the model uninitialised (meta device), then fill it from the checkpoint in `dtype`; with
    weight_dtype "int8" or "int4" the projections and LM head are quantised as they load (engine/model/quant.py),
    or as a WeightChoice names for each ("auto" here is bfloat16: the loader resolves it from the file first,
    quant.choose_weight_dtype). `model_class`: the architecture's (engine/model/loader.py model_class), LlamaModel
    where None."""
    with torch.device("meta"):
        model = (model_class or LlamaModel)(cfg, device)
    if isinstance(weight_dtype, str):
        chosen = quant.resolve_weight_dtype(weight_dtype)
        weight_dtype = quant.WeightChoice(chosen, chosen)
    quant.apply_layout(model, weight_dtype, device)
    _materialise(model, dtype, device)
    model.load_weights(weights)
    model.eval().requires_grad_(False)
    model.set_backend(TorchBackend(device))
    return model


def _norm_weight(norm: RMSNorm | None) -> torch.Tensor | None:
    return None if norm is None else norm.weight


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
