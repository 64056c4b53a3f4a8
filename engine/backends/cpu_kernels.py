"""The CPU kernel backend: bf16 on a CPU whose kernels built (engine/kernels/cpu_ext.py).

What the CPU and the config allow is decided once, at construction: the matrix engine, the dispatch table (which
kernel serves each weight format's row counts: measured on this machine, or the shipped one; dispatch.py), the
packing it implies, the fused elementwise kernels, the in-place attention, the decode stack. Per call only the row
counts (and, for attention, the format of a layer's pages) choose among the paths, in `linear`, `decode_attention`
and `decode_layers`.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.nn.functional as F

from engine.backends import weight_ops
from engine.backends.base import Rope, StackLayer, StackShape
from engine.backends.cpu_config import CpuKernelConfig
from engine.backends.dispatch import ENGINES, FALLBACKS, FORMATS, PACKED, DispatchTable, native_bf16, valid_kernels
from engine.backends.torch_ops import TorchBackend, split_heads
from engine.backends.weight_ops import Weight
from engine.kernels import cpu_ext, packed_linear
from engine.kv.formats import QuantizedPages

if TYPE_CHECKING:
    from engine.backends.attention import AttentionMetadata


class CpuKernelBackend(TorchBackend):
    name = "cpu-kernels"

    def __init__(self, config: CpuKernelConfig = CpuKernelConfig()) -> None:
        """Loads (or builds) the kernels: raises KernelBuildError where they cannot be."""
        super().__init__("cpu")
        self.config = config
        vectorized = cpu_ext.vectorized()  # without AVX-512 only the GEMV and oneDNN's packing beat torch
        self.engine = _matrix_engine(config.matrix_engine, cpu_ext.matrix_engines())
        self.elementwise = config.fused_elementwise and vectorized
        self.attends_in_place = vectorized
        self.candidates = config.candidates(available_kernels(), self.engine)  # what a measured table times here
        self.dispatch = config.dispatch or config.shipped_table(self.candidates, native_bf16(cpu_ext.key().features))
        _check_runs_here(self.dispatch)
        # the bf16 weights' packed copy (a weight whose blocks do not fit takes oneDNN's where the table reads the
        # blocks); a table's engine is the engine of every product on blocks
        self.packing = self.dispatch.packing()
        self.tiled = self.packing in ENGINES
        self.engine = self.packing if self.tiled else self.engine
        self.onednn = self.packing is not None and packed_linear.onednn_available()
        self.fused_gate_up = config.fused_gate_up and self.tiled and self.elementwise
        # the C++ stack runs the packed products on the first engine ("auto"), as the Python layers do by default
        self.stacks = (config.decode_stack and self.elementwise and self.attends_in_place
                       and (self.engine is None or self.engine == cpu_ext.matrix_engines()[0]))

    # ---- prepare: the packed copies and the decode stack, once per model ----------------------------------

    def check_dtype(self, dtype: torch.dtype) -> None:
        if dtype != torch.bfloat16:
            raise ValueError(f"the CPU kernels take bf16 models, not {dtype}")

    def prepare_linear(self, data: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None) -> Weight:
        """A bf16 weight with its packed copy; int8 codes with their W8A8 copy where that kernel runs (an int4
        weight is the kernel's layout itself)."""
        if scale is None:
            return Weight(data, bias=bias, packed=self.pack(data))
        w8a8 = data.dtype == torch.int8 and scale.dim() == 1 and self.dispatch.int8.uses("w8a8")
        return Weight(data, bias=bias, scale=scale, packed=weight_ops.pack_w8a8(data) if w8a8 else None)

    def prepare_gate_up(self, data: torch.Tensor, scale: torch.Tensor | None) -> Weight:
        """The interleaved copy for the fused product where it packs, and then no packed copy of its own: 2+ rows
        take the fused copy, one row the GEMV."""
        fused = self.pack_gate_up(data) if scale is None else None
        return self.prepare_linear(data, None, scale) if fused is None else Weight(data, silu_fused=fused)

    def pack(self, weight: torch.Tensor) -> torch.Tensor | None:
        """weight [N, K] bf16 -> its packed copy (16x16-pair blocks: 4-D; oneDNN's: 2-D), or None."""
        if weight.dtype != torch.bfloat16 or weight.dim() != 2 or self.packing is None:
            return None
        if self.tiled and packed_linear.blocks_fit(weight):
            return packed_linear.pack_blocks(weight)
        return packed_linear.pack_onednn(weight, self.config.onednn_batch_hint) if self.onednn else None

    def pack_gate_up(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The MLP's gate|up weight -> its interleaved blocks for the fused product, or None (not fused here)."""
        return packed_linear.pack_gate_up(weight) if self.fused_gate_up else None

    def decode_stack(self, layers: Sequence[StackLayer], shape: StackShape) -> object | None:
        if not self.stacks:
            return None
        stack = cpu_ext.decode_stack(shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.eps, shape.scale)
        formats = set()
        for layer in layers:
            stack.add_layer(layer.input_norm, _projection(layer.qkv), _projection(layer.o), layer.post_attention_norm,
                            _projection(layer.gate_up), _projection(layer.down), layer.gate_up.silu_fused,
                            layer.q_norm, layer.k_norm)
            formats |= {weight_ops.weight_format(w.data, w.scale) for w in (layer.qkv, layer.o, layer.gate_up,
                                                                            layer.down)}
        return NativeStack(stack, frozenset(formats))

    # ---- the operations -------------------------------------------------------------------------------------

    def max_packed_rows(self, packed: torch.Tensor) -> int:
        """The most rows a product on a packed copy takes (from 2; one row is never a packed copy's)."""
        return self.dispatch.bf16.last_row(self.packing) if self.packing else 0

    def linear_float(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        """The dispatch table's bf16 kernel for this row count: the packed copy, the streaming GEMV or F.linear. Where
        the table names a packed copy the weight lacks (or oneDNN's, which rounds, for fp32 logits), the GEMV serves
        up to max_gemv_rows rows, else F.linear. decode_stack.cpp's project() makes the same choice from the limits
        `stack_limits` gives it."""
        out = self._bf16_kernel(x, w.data, w.bias, w.packed, fp32_out=False)
        if out is not None:
            return out
        return self._linear_fp32(x, w) if self.dispatch.bf16.kernel(x.shape[0]) == "linear32" else \
            F.linear(x, w.data, w.bias)

    def _linear_fp32(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        """The table's "linear32": F.linear in fp32 on chunks of the weight widened or dequantised to fp32 (the
        file's values, exactly, an int4 or int8g weight by the kernels' dequantisers), plus the bias, rounded once
        to x's dtype."""
        out = weight_ops.linear_fp32(x, w.data, w.scale, self._rows_fp32(w, x))
        if w.bias is not None:
            out += w.bias
        return out.to(x.dtype)

    def _rows_fp32(self, w: Weight, x: torch.Tensor) -> Callable[[int, int], torch.Tensor] | None:
        """(begin, end) -> those output channels of an int4 or int8g weight in fp32 by the kernels' dequantisers
        (weight_ops.weight_rows_fp32's bits, in a fraction of the time); None for the others (torch's widening)."""
        k = x.shape[-1]
        if w.scale is not None and weight_ops.is_int4(w.data):
            return functools.partial(cpu_ext.dequantize_int4, w.data, w.scale, k, fp32_out=True)
        if weight_ops.is_int8g(w.data, w.scale):
            return functools.partial(cpu_ext.dequantize_int8g, w.data, w.scale, k, fp32_out=True)
        return None

    def _bf16_kernel(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     packed: torch.Tensor | None, fp32_out: bool) -> torch.Tensor | None:
        """linear()'s kernels (oneDNN's packed copy only without fp32_out: it rounds to bf16); None for F.linear."""
        rows = x.shape[0]
        kernel = self.dispatch.bf16.kernel(rows)
        if kernel in PACKED and packed is not None:
            if packed.dim() == 4:
                return cpu_ext.tiled_linear(x, packed, bias, self.engine, fp32_out)
            if not fp32_out:
                return packed_linear.onednn_linear(x, packed, bias)
        if kernel == "gemv" or (kernel in PACKED and rows <= self.config.max_gemv_rows):
            return cpu_ext.linear_bf16(x, weight, bias, fp32_out)
        return None

    def linear_int8(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        """The dispatch table's int8 kernel for this row count: W8A8 (x quantised to int8 per row, int32 sums on VNNI;
        on the weight's W8A8 copy), the int8 kernel (weights widened to fp32 in registers), or F.linear on the weight
        dequantised to bf16 (linear32: to fp32). decode_stack.cpp's project() makes the same choice."""
        out = self._int8_kernel(x, w, w.bias, fp32_out=False)
        if out is not None:
            return out
        return self._linear_fp32(x, w) if self.dispatch.int8.kernel(x.shape[0]) == "linear32" else \
            super().linear_int8(x, w)

    def _int8_kernel(self, x: torch.Tensor, w: Weight, bias: torch.Tensor | None,
                     fp32_out: bool) -> torch.Tensor | None:
        kernel = self.dispatch.int8.kernel(x.shape[0])
        if kernel in FALLBACKS or x.dtype != torch.bfloat16:
            return None
        if w.packed is not None and kernel == "w8a8":
            return cpu_ext.linear_w8a8(x, w.packed, w.scale, bias, fp32_out)
        return cpu_ext.linear_int8(x, w.data, w.scale, bias, fp32_out)

    def _int4_kernel(self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                     fp32_out: bool) -> torch.Tensor | None:
        if x.dtype != torch.bfloat16:
            return None
        kernel = self.dispatch.int4.kernel(x.shape[0])
        if kernel == "w4a8":
            return cpu_ext.linear_w4a8(x, packed, scales, bias, fp32_out)
        if kernel == "int4":
            return cpu_ext.linear_int4(x, packed, scales, bias, fp32_out)
        if kernel == "int4_gemm":
            return cpu_ext.linear_int4_gemm(x, packed, scales, bias, fp32_out)
        if kernel == "int4_bf16":
            return cpu_ext.linear_int4_bf16(x, packed, scales, bias, fp32_out)
        return None

    def _int8g_kernel(self, x: torch.Tensor, w: Weight, bias: torch.Tensor | None,
                      fp32_out: bool) -> torch.Tensor | None:
        kernel = self.dispatch.int8g.kernel(x.shape[0])
        if kernel == "int8g_bf16" and x.dtype == torch.bfloat16:
            return cpu_ext.linear_int8g_bf16(x, w.data, w.scale, bias, fp32_out)
        if x.dtype not in (torch.bfloat16, torch.float32) or kernel != "int8g":
            return None
        return cpu_ext.linear_int8g(x, w.data, w.scale, bias, fp32_out)

    def linear_int8g(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        """The dispatch table's int8g kernel for this row count: the weight-only kernel (the weights exact in
        registers) or its GEMM on bf16 dot products, or F.linear on chunks of the weight dequantised to bf16 by the
        kernel's dequantize_int8g (linear32: to fp32, exactly). decode_stack.cpp's project() makes the same
        choice."""
        out = self._int8g_kernel(x, w, w.bias, fp32_out=False)
        if out is not None:
            return out
        if x.dtype != torch.bfloat16:
            return super().linear_int8g(x, w)
        if self.dispatch.int8g.kernel(x.shape[0]) == "linear32":
            return self._linear_fp32(x, w)
        k = x.shape[-1]
        return weight_ops.linear_int8g(x, w.data, w.scale, w.bias,
                                       lambda begin, end: cpu_ext.dequantize_int8g(w.data, w.scale, k, begin, end))

    def lm_head(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        """The kernel that linear_float / linear_int8 / linear_int4 / linear_int8g would choose, keeping its fp32
        sums; else the base's fp32 F.linear."""
        if w.scale is None:
            out = self._bf16_kernel(x, w.data, None, w.packed, fp32_out=True) if x.dtype == torch.bfloat16 else None
        elif weight_ops.is_int4(w.data):
            out = self._int4_kernel(x, w.data, w.scale, None, fp32_out=True)
        elif weight_ops.is_int8g(w.data, w.scale):
            out = self._int8g_kernel(x, w, None, fp32_out=True)
        else:
            out = self._int8_kernel(x, w, None, fp32_out=True)
        return super().lm_head(x, w) if out is None else out

    def linear_int4(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        """The dispatch table's int4 kernel for this row count: W4A8, the weight-only kernel (or its AVX-512 GEMM),
        or F.linear on chunks of the weight dequantised to bf16 by the kernel's dequantize_int4 (linear32: to
        fp32, exactly). decode_stack.cpp's project() makes the same choice."""
        if x.dtype != torch.bfloat16:
            return super().linear_int4(x, w)
        out = self._int4_kernel(x, w.data, w.scale, w.bias, fp32_out=False)
        if out is not None:
            return out
        if self.dispatch.int4.kernel(x.shape[0]) == "linear32":
            return self._linear_fp32(x, w)
        k = x.shape[-1]
        return weight_ops.linear_int4(x, w.data, w.scale, w.bias,
                                      lambda begin, end: cpu_ext.dequantize_int4(w.data, w.scale, k, begin, end))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return cpu_ext.rms_norm(x, weight, eps)[0] if self.elementwise else super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if self.elementwise:
            return cpu_ext.rms_norm(x, weight, eps, residual)
        return super().add_rms_norm(x, residual, weight, eps)

    def rotary(self, qkv: torch.Tensor, rope: Rope, num_heads: int, num_kv_heads: int,
               head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not self.elementwise:
            return super().rotary(qkv, rope, num_heads, num_kv_heads, head_dim)
        cpu_ext.rotary_(qkv, *rope, num_heads + num_kv_heads, head_dim)  # the q and k heads, in place
        return split_heads(qkv, num_heads, num_kv_heads, head_dim)

    def gate_up_silu(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        if w.silu_fused is not None and x.shape[0] >= 2:  # one row: the GEMV on the plain weight
            return cpu_ext.tiled_linear_silu_mul(x, w.silu_fused, self.engine)
        gate_up = self.linear(x, w)
        if self.elementwise:
            return cpu_ext.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def decode_attention(self, q: torch.Tensor, k_cache: object, v_cache: object, meta: AttentionMetadata,
                         scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor | None:
        """The C++ kernels compute neither a window nor a soft-cap: they serve where the window cuts no context."""
        if (not self.attends_in_place or meta.num_decode_seqs > self.config.max_attention_seqs or softcap is not None
                or (window is not None and meta.max_decode_context > window)):
            return None
        if _plain_bf16_pages(k_cache):
            return cpu_ext.decode_attention_bf16(q, k_cache, v_cache, meta.decode_block_tables,
                                                 meta.decode_context_lens, scale)
        if _fp8_pages(k_cache, v_cache):
            block_size, kv_heads, head_dim = k_cache.format.page_shape
            return cpu_ext.decode_attention_fp8(q, k_cache.raw, v_cache.raw, k_cache.format.fields[1].offset,
                                                block_size, kv_heads, head_dim, meta.decode_block_tables,
                                                meta.decode_context_lens, scale)
        return None

    def takes_prompts(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int) -> bool:
        """Whether the prompt-attention kernel takes these views: bf16, head_dim a multiple of 32, prompts of at
        most max_prompt_attention_tokens, heads and dims contiguous in each row (the fused qkv's views are)."""
        rows, _, head_dim = q.shape
        return (self.engine is not None and q.dtype == torch.bfloat16 and head_dim % 32 == 0
                and rows // count <= self.config.max_prompt_attention_tokens
                and all(x.dtype == q.dtype and x.stride(2) == 1 and x.stride(1) == head_dim and x.stride(0) % 2 == 0
                        for x in (q, k, v)))

    def fresh_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int, scale: float,
                        window: int | None = None, softcap: float | None = None) -> torch.Tensor | None:
        if window is not None or softcap is not None or not self.takes_prompts(q, k, v, count):
            return None
        return cpu_ext.prompt_attention(q, k, v, count, scale, self.engine)

    def extend_attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, context: int,
                         scale: float, window: int | None = None,
                         softcap: float | None = None) -> torch.Tensor | None:
        if (window is not None or softcap is not None or len(keys) > self.config.max_prompt_attention_tokens
                or not self.takes_prompts(q, keys, values, 1)):
            return None
        return cpu_ext.prompt_attention(q, keys, values, 1, scale, self.engine, context)

    def paged_extend_attention(self, q: torch.Tensor, k_cache: object, v_cache: object, block_table: torch.Tensor,
                               context: int, scale: float, window: int | None = None,
                               softcap: float | None = None) -> torch.Tensor | None:
        """Plain bf16 pages of a multiple of 16 tokens only (a 16-key tile of the kernel stays in one page)."""
        if (window is not None or softcap is not None or not _plain_bf16_pages(k_cache)
                or not _plain_bf16_pages(v_cache) or k_cache.shape[1] % 16
                or context + len(q) > self.config.max_prompt_attention_tokens
                or not self.takes_prompts(q, q, q, 1) or q.shape[2] != k_cache.shape[3]):
            return None
        return cpu_ext.prompt_attention(q, k_cache, v_cache, 1, scale, self.engine, context, block_table)

    def decode_layers(self, stack: object | None, x: torch.Tensor, rope: Rope, meta: AttentionMetadata,
                      kv_caches: list, window: int | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The C++ stack where it computes exactly what the layers would: a decode-only step (one token a row, all
        in the attention kernel's group) on plain bf16 pages (no quantised or tiered caches) in every layer, every
        context within the window, no layer's product sent to linear32."""
        if (not isinstance(stack, NativeStack) or not kv_caches or not meta.use_kernels or meta.prefills
                or not 0 < meta.num_decode == x.shape[0] or meta.num_decode_seqs > self.config.max_attention_seqs
                or (window is not None and meta.max_decode_context > window)
                or not all(_plain_bf16_pages(k) and _plain_bf16_pages(v) for k, v in kv_caches)):
            return None
        if any(self.dispatch.route(fmt).kernel(x.shape[0]) == "linear32" for fmt in stack.formats):
            return None  # the stack's own F.linear is bf16's
        x, residual = stack.native.forward(x, *rope, meta.slot_mapping, meta.decode_block_tables,
                                           meta.decode_context_lens, kv_caches, *self.stack_limits(x.shape[0]))
        return x, residual

    def stack_limits(self, rows: int) -> tuple[int, ...]:
        """decode_stack.cpp's row limits (gemv, oneDNN copy, blocks, int8, W8A8, W4A8, int4, int8g, int4 GEMM, int4
        and int8g on bf16 dot products) that make its project() pick linear()'s kernels at `rows` rows: `rows` for
        the kernel the table names (and for the GEMV behind a packed copy, as linear_float falls back to it), 0 for
        the rest."""
        bf16, int8, int4, int8g = (self.dispatch.route(fmt).kernel(rows) for fmt in ("bf16", "int8", "int4", "int8g"))
        packed = rows if bf16 in PACKED else 0
        gemv = bf16 == "gemv" or (packed and rows <= self.config.max_gemv_rows)  # project(): after the packed copy
        return (rows if gemv else 0, packed, packed, 0 if int8 in FALLBACKS else rows,
                rows if int8 == "w8a8" else 0, rows if int4 == "w4a8" else 0, 0 if int4 in FALLBACKS else rows,
                rows if int8g == "int8g" else 0, rows if int4 == "int4_gemm" else 0,
                rows if int4 == "int4_bf16" else 0, rows if int8g == "int8g_bf16" else 0)

    def greedy_tokens(self, hidden: torch.Tensor, head: Weight) -> torch.Tensor | None:
        """The argmax as the LM head's results come out, where the head is bf16 packed in blocks (and the row count
        within their limit) or int8g on bf16 dot products at this row count."""
        if hidden.dtype != torch.bfloat16 or hidden.shape[0] < 2:
            return None
        if weight_ops.is_int8g(head.data, head.scale):
            if self.dispatch.int8g.kernel(hidden.shape[0]) != "int8g_bf16":
                return None
            return cpu_ext.linear_int8g_bf16_argmax(hidden, head.data, head.scale)
        packed = head.packed
        if (head.scale is not None or packed is None or packed.dim() != 4
                or self.dispatch.bf16.kernel(hidden.shape[0]) not in ENGINES):
            return None
        return cpu_ext.tiled_linear_argmax(hidden, packed, self.engine)

    def describe(self) -> dict[str, Any]:
        key = cpu_ext.key()
        return {"backend": self.name, "device": "cpu", "matrix_engine": self.engine, "kernels": self.kernels(),
                "dispatch": self.dispatch.describe(), "build_key": key.name, "cpu_features": list(key.features)}

    def kernels(self) -> list[str]:
        """The kernels this backend runs (where the row counts and page formats of a step allow)."""
        table = self.dispatch
        on = {"gemv": table.bf16.uses("gemv"), "packed_blocks": self.tiled, "onednn_packed": self.onednn,
              "fused_gate_up": self.fused_gate_up, "lm_head_argmax": self.tiled or table.int8g.uses("int8g_bf16"),
              "decode_attention_bf16": self.attends_in_place, "decode_attention_fp8": self.attends_in_place,
              "prompt_attention": self.engine is not None, "linear_int8": table.int8.uses("int8"),
              "linear_w8a8": table.int8.uses("w8a8"), "linear_w4a8": table.int4.uses("w4a8"),
              "linear_int4": table.int4.uses("int4"), "linear_int4_gemm": table.int4.uses("int4_gemm"),
              "linear_int4_bf16": table.int4.uses("int4_bf16"),
              "linear_int8g": table.int8g.uses("int8g"), "linear_int8g_bf16": table.int8g.uses("int8g_bf16"),
              "rms_norm": self.elementwise,
              "rotary": self.elementwise, "silu_mul": self.elementwise, "decode_stack": self.stacks,
              "linear_fp32": any(table.route(fmt).uses("linear32") for fmt in FORMATS)}
        return [name for name, used in on.items() if used]


@dataclass(frozen=True)
class NativeStack:
    """decode_stack.cpp's DecodeStack and the weight formats of its layers: a step whose table sends one of them to
    linear32 runs the layers from Python (the stack multiplies in bf16 where the table names F.linear)."""

    native: object
    formats: frozenset[str]


def available_kernels() -> dict[str, tuple[str, ...]]:
    """Per format, the kernels whose vector code this build has (dispatch.valid_kernels of its features) and that
    run in this process: the tiles where the OS grants AMX state, oneDNN's copy where this torch packs bf16."""
    engines = cpu_ext.matrix_engines()
    runs = {"tiles": "tiles" in engines, "vectors": "vectors" in engines, "onednn": packed_linear.onednn_available(),
            "w8a8": cpu_ext.w8a8_vnni(), "w4a8": cpu_ext.w4a8_vnni(), "int4": cpu_ext.int4_vectorized(),
            "int4_gemm": cpu_ext.int4_gemm_vectorized(), "int4_bf16": cpu_ext.int4_bf16_vectorized(),
            "int8g_bf16": cpu_ext.int8g_bf16_vectorized()}
    return {fmt: tuple(k for k in kernels if runs.get(k, True))
            for fmt, kernels in valid_kernels(cpu_ext.key().features).items()}


def _check_runs_here(table: DispatchTable) -> None:
    """ValueError where the table names a packed kernel this process cannot run (the others have scalar loops)."""
    engines, onednn = cpu_ext.matrix_engines(), packed_linear.onednn_available()
    missing = [k for k in table.bf16.kernels if (k in ENGINES and k not in engines) or (k == "onednn" and not onednn)]
    if missing:
        raise ValueError(f"the dispatch table names {missing}, which do not run here (engines here: "
                         f"{engines or 'none'}; oneDNN's packing: {'yes' if onednn else 'no'})")


def _matrix_engine(asked: str, engines: tuple[str, ...]) -> str | None:
    """The engine of the products on packed blocks: the one asked for, or the fastest here for "auto"."""
    if asked == "auto":
        return engines[0] if engines else None
    if asked not in engines:
        raise ValueError(f"matrix engine {asked!r} is not available here (this CPU and build have {engines or 'none'})")
    return asked


def _projection(w: Weight) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """A Weight's tensors as decode_stack.cpp takes them: an int8 weight's packed copy is its W8A8 copy."""
    return w.data, w.bias, w.packed, w.scale


def _plain_bf16_pages(cache: object) -> bool:
    return isinstance(cache, torch.Tensor) and cache.dtype == torch.bfloat16 and cache.is_cpu


def _fp8_pages(k_cache: object, v_cache: object) -> bool:
    # exact types: a TieredPages (hot and cold regions) keeps the gather path
    return (type(k_cache) is QuantizedPages and type(v_cache) is QuantizedPages
            and k_cache.format.name == "fp8" and v_cache.format == k_cache.format
            and k_cache.dtype == torch.bfloat16 and k_cache.raw.device.type == "cpu"
            and k_cache.raw.is_contiguous() and v_cache.raw.is_contiguous())
