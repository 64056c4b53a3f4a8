"""The C++ CPU kernels (engine/kernels/*.cpp), one typed function each over the torch operators they register
(torch.ops.phase_serve.*, visible to the dispatcher and torch.compile). Nothing here chooses: which kernel runs
for which product, step or row count is engine/backends/cpu_kernels.py's decision, from its CpuKernelConfig.

- `linear_bf16`: x W^T + b for a few rows, each weight row streamed once (oneDNN's bf16 GEMM is built for large
  batches).
- `linear_int8`: the same for int8 weights with per-output-channel scales, widened to fp32 in registers.
- `linear_w8a8`: the same int8 weights against each row of x quantised to int8, int32 sums on AVX-512 VNNI.
- `linear_w4a8` / `linear_int4` / `linear_int4_gemm` / `linear_int4_bf16` / `dequantize_int4`: int4 weights with
  group scales and offsets, on int8, fp32 or (bf16 dot products) bf16 activations; and to bf16 rows.
- `linear_int8g` / `linear_int8g_bf16` (`_argmax`) / `dequantize_int8g`: int8g weights (int8 codes in blocks of
  16 channels, fp32 scales and offsets per 16 along K, a GGUF file's values exactly) against fp32 (or, bf16 dot
  products, bf16) activations; and to bf16 rows.
- `decode_attention_bf16` / `_fp8`: one query a row against its context read in place from the pages through its
  block table (no gather copy, no padding mask); fp8 pages decoded to bf16 in registers.
- `rms_norm` (+ the residual add), `silu_mul`, `rotary_`: one pass each instead of 3-10 torch ops, rounding to
  bf16 wherever the torch ops store an intermediate.
- `tile_pack` / `tiled_linear*`: products on weights packed once into 16x16-pair blocks, on AMX tiles or
  AVX-512 BF16 vectors (`matrix_engines`); `_argmax` and `_silu_mul` reduce the product as it comes out.
- `prompt_attention`: causal attention of whole prompts, or of a chunk after its cached prefix, on the same
  engines.
- `decode_stack`: the decoder layers of a decode-only step in one call, in the Python layers' order (same bits).

All run on torch's intra-op pool (at::parallel_for): a kernel with its own OpenMP runtime fought torch's threads
for the same cores. Figures, and the bench command of each: docs/performance.md.
"""
from __future__ import annotations

import functools
from types import ModuleType

import torch

from engine.kernels.extension_build import BuildKey, KernelBuildError, build_key, load

KERNEL_MAX_PROMPT_TOKENS = 8192  # prompt_attention.cpp's own limit: one item's scores stay in L2


@functools.cache
def _outcome() -> tuple[BuildKey, ModuleType | None, KernelBuildError | None]:
    key = build_key()
    try:
        return key, load(key), None
    except KernelBuildError as exc:
        return key, None, exc


def extension() -> ModuleType:
    """The compiled module of this checkout and CPU (it holds the decode stack and registers the operators), built
    on first use; raises KernelBuildError."""
    _, module, error = _outcome()
    if error is not None:
        raise error
    return module


def ops() -> object:
    """torch.ops.phase_serve, once the extension that registers it is loaded."""
    extension()
    return torch.ops.phase_serve


def key() -> BuildKey:
    """The build key of the extension this process loads (or fails to)."""
    return _outcome()[0]


@functools.cache
def vectorized() -> bool:
    """Whether the extension was built with its AVX-512 paths (its scalar fallbacks lose to torch)."""
    return bool(ops().vectorized())


@functools.cache
def matrix_engines() -> tuple[str, ...]:
    """The engines of the products on packed blocks here, fastest first: "tiles" (AMX, with the tile state granted
    by the OS), "vectors" (AVX-512 BF16); empty where neither was compiled in."""
    names = engine_names()
    return tuple(names[code] for code in ops().matrix_engines())


@functools.cache
def engine_names() -> tuple[str, ...]:
    """The kernels' engine arguments by code ("auto" first), as amx.h names them."""
    return tuple(ops().engine_names())


def _engine_code(engine: str) -> int:
    names = engine_names()
    if engine not in names:
        raise ValueError(f"engine must be one of {names}, not {engine!r}")
    return names.index(engine)


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                fp32_out: bool = False) -> torch.Tensor:
    """x [M, K] bf16, weight [N, K] bf16 (contiguous), bias [N] -> [M, N] bf16, rounded once from fp32 (the fp32
    sums themselves with fp32_out, as every product below offers: the LM head's logits)."""
    return ops().linear_bf16(x, weight, bias, fp32_out)


def linear_int8(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None, fp32_out: bool = False) -> torch.Tensor:
    """x [M, K] bf16, codes [N, K] int8 (contiguous), scale [N] fp32, bias [N] -> [M, N] bf16 =
    (x codes^T) * scale + bias, the sums in fp32 and rounded once (engine/model/quant.py's format)."""
    return ops().linear_int8(x, codes, scale, bias, fp32_out)


def linear_w8a8(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None, fp32_out: bool = False) -> torch.Tensor:
    """linear_int8's arguments and result, with each row of x quantised to int8 first (a = max |x| / 127 per row,
    q = round(x / a), nearest even): bf16(float(q codes^T) * (a * scale) + bias), the sums exact in int32."""
    return ops().linear_w8a8(x, codes, scale, bias, fp32_out)


@functools.cache
def w8a8_vnni() -> bool:
    """Whether linear_w8a8 was built on AVX-512 VNNI here (its scalar fallback is for tests only)."""
    return bool(ops().w8a8_vnni())


def linear_w4a8(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None, fp32_out: bool = False) -> torch.Tensor:
    """x [M, K] bf16, an int4 weight (engine/model/quant.py: packed uint8 [ceil(N / 16), ceil(K / 32), 4, 16, 4],
    scales fp16 [2, ceil(K / 32), N]), bias [N] -> [M, N] bf16, with each row of x quantised to int8 in groups of
    32: bf16(sum_g (a_g s_g float((q - 7.5) x_q) + (z_g + 7.5 s_g) sum_g x) + bias), the groups' sums exact in
    int32 (the weights' middle meets x's own sums)."""
    return ops().linear_w4a8(x, packed, scales, bias, fp32_out)


def linear_int4(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None, fp32_out: bool = False) -> torch.Tensor:
    """linear_w4a8's arguments and result, weight-only: the codes widened to fp32 against x in fp32,
    bf16(sum_g (s_g sum_k q x + z_g sum_g x) + bias), every sum in fp32. x may be bf16 or fp32."""
    return ops().linear_int4(x, packed, scales, bias, fp32_out)


@functools.cache
def int4_vectorized() -> bool:
    """Whether linear_int4 was built on AVX2 vectors here (its scalar fallback is for tests only)."""
    return bool(ops().int4_vectorized())


def linear_int4_gemm(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                     bias: torch.Tensor | None = None, fp32_out: bool = False) -> torch.Tensor:
    """linear_int4's arguments and result to the bit, on AVX-512 for many rows: each group of weights widened once
    per pass of up to 8 rows."""
    return ops().linear_int4_gemm(x, packed, scales, bias, fp32_out)


@functools.cache
def int4_gemm_vectorized() -> bool:
    """Whether linear_int4_gemm was built on AVX-512 here (elsewhere it runs linear_int4's loops: tests only)."""
    return bool(ops().int4_gemm_vectorized())


def linear_int4_bf16(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                     bias: torch.Tensor | None = None, fp32_out: bool = False) -> torch.Tensor:
    """linear_int4's product (the file's weights, never rounded) on AVX-512 BF16 dot products for many rows: the
    codes, exact in bf16, widened once per call; fp32 sums in another order than linear_int4's."""
    return ops().linear_int4_bf16(x, packed, scales, bias, fp32_out)


@functools.cache
def int4_bf16_vectorized() -> bool:
    """Whether linear_int4_bf16 was built on AVX-512 BF16 here (elsewhere it runs linear_int4_gemm: tests only)."""
    return bool(ops().int4_bf16_vectorized())


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, k: int, begin: int, end: int,
                    fp32_out: bool = False) -> torch.Tensor:
    """Output channels [begin, end) of an int4 weight of K columns -> bf16 (fp32_out: fp32) [end - begin, K],
    weight_ops.int4_rows' bits."""
    return ops().dequantize_int4(packed, scales, k, begin, end, fp32_out)


@functools.cache
def w4a8_vnni() -> bool:
    """Whether linear_w4a8 was built on AVX-512 VNNI here (its scalar fallback is for tests only)."""
    return bool(ops().w4a8_vnni())


def linear_int8g(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                 fp32_out: bool = False) -> torch.Tensor:
    """x [M, K] bf16 or fp32, an int8g weight (weight_ops.int8g_shapes: codes int8 [ceil(N / 16), G, 256], scales
    fp32 [1 or 2, G', N] or [N / 16, G', 1 or 2, 16]: s, or s and z, G' = G or ceil(K / 32)), bias [N] -> [M, N]
    bf16 (fp32 with fp32_out) = x W^T + bias with W = s q (+ z), the file's values, never rounded: each group's fp32
    sum of q x against x in fp32, then s dot + z t."""
    return ops().linear_int8g(x, codes, scales, bias, fp32_out)


def linear_int8g_bf16(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                      fp32_out: bool = False) -> torch.Tensor:
    """linear_int8g's product (s q + z never rounded) on AVX-512 BF16 dot products: the codes, exact in bf16, widened
    in registers for up to 8 rows, once per call for more; fp32 sums in another order than linear_int8g's."""
    return ops().linear_int8g_bf16(x, codes, scales, bias, fp32_out)


def linear_int8g_bf16_argmax(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 (M >= 1), an int8g weight -> [M] int64 = the argmax of linear_int8g_bf16(x, codes, scales,
    fp32_out=True) (torch's max), without writing the [M, N] product: the greedy pick straight off the LM head."""
    return ops().linear_int8g_bf16_argmax(x, codes, scales)


@functools.cache
def int8g_bf16_vectorized() -> bool:
    """Whether linear_int8g_bf16 was built on AVX-512 BF16 here (elsewhere it runs linear_int8g: tests only)."""
    return bool(ops().int8g_bf16_vectorized())


def dequantize_int8g(codes: torch.Tensor, scales: torch.Tensor, k: int, begin: int, end: int,
                     fp32_out: bool = False) -> torch.Tensor:
    """Output channels [begin, end) of an int8g weight of K columns -> bf16 (fp32_out: fp32) [end - begin, K],
    weight_ops.int8g_rows' bits."""
    return ops().dequantize_int8g(codes, scales, k, begin, end, fp32_out)


def decode_attention_bf16(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                          block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, D] bf16; pages [num_blocks, bs, Hkv, D] bf16; block_tables [B, nb] int64 (entries and slots
    past a row's context are never read); context_lens [B] int64 (>= 1) -> [B, Hq, D] bf16."""
    return ops().decode_attention_bf16(q, k_pages, v_pages, block_tables, context_lens, scale)


def decode_attention_fp8(q: torch.Tensor, k_raw: torch.Tensor, v_raw: torch.Tensor, scale_offset: int,
                         block_size: int, kv_heads: int, head_dim: int, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, D] bf16; k_raw/v_raw [num_blocks, page_bytes] uint8 fp8 pages (engine/kv/formats.py: codes
    [bs, Hkv, D] e4m3 at byte 0, scales [Hkv] fp32 at byte `scale_offset`), read in place; block_tables
    [B, nb] int64; context_lens [B] int64 (>= 1) -> [B, Hq, D] bf16."""
    return ops().decode_attention_fp8(q, k_raw, v_raw, scale_offset, block_size, kv_heads, head_dim,
                                            block_tables, context_lens, scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] bf16 -> (RMSNorm(s) [T, H], s) with s = residual + x (s = x without a residual), each rounded
    to bf16 where the torch ops round."""
    return tuple(ops().rms_norm_bf16(x, residual, weight, eps))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] bf16 (gate | up) -> silu(gate) * up [T, I] bf16."""
    return ops().silu_mul_bf16(gate_up)


def rotary_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
    """Rotates the first `heads` heads of each row of qkv [T, >= heads * D] bf16 in place (half-split layout);
    cos, sin [T, 1, D/2] (or [T, D/2]) bf16, as RotaryEmbedding.lookup returns them."""
    ops().rotary_bf16_(qkv, cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1), heads, head_dim)


def tile_pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 (N % 16 == 0, K % 32 == 0) -> 16x16-pair blocks [N/16, K/32, 16, 32] for `tiled_linear`."""
    return ops().tile_pack_bf16(weight)


def tiled_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
                 engine: str = "auto", fp32_out: bool = False) -> torch.Tensor:
    """x [M, K] bf16, packed from `tile_pack` -> [M, N] bf16 = x W^T + b, fp32 sums rounded once (kept with
    fp32_out)."""
    return ops().tiled_linear_bf16(x, packed, bias, _engine_code(engine), fp32_out)


def tiled_linear_silu_mul(x: torch.Tensor, packed: torch.Tensor, engine: str = "auto") -> torch.Tensor:
    """x [M, K] bf16, packed: `tile_pack` of a gate|up weight [2I, K] with its 16-row blocks interleaved (gate
    block j, then up block j; packed_linear.pack_gate_up) -> silu(gate) * up [M, I] bf16, silu_mul of the plain
    product to the bit, without writing the [M, 2I] product."""
    return ops().tiled_linear_silu_mul_bf16(x, packed, _engine_code(engine))


def tiled_linear_argmax(x: torch.Tensor, packed: torch.Tensor, engine: str = "auto") -> torch.Tensor:
    """x [M, K] bf16 (M >= 1), packed from `tile_pack` -> [M] int64 = the argmax of tiled_linear(x, packed,
    fp32_out=True) (torch's max), without writing the [M, N] product: the greedy pick straight off the LM head."""
    return ops().tiled_linear_argmax_bf16(x, packed, _engine_code(engine))


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int, scale: float,
                     engine: str = "auto", context: int = 0, block_table: torch.Tensor | None = None) -> torch.Tensor:
    """q [count * S, Hq, D], k/v [count * (C + S), Hkv, D] bf16: `count` chunks of S queries, one after another,
    each after C = `context` cached keys (its keys hold those first) -> [count * S, Hq, D] bf16, query i of a chunk
    attending causally to keys [0, C + i]. C = 0: whole prompts attending to themselves. With `block_table`
    (int64, count 1), k / v are the KV pages [N, block_size, Hkv, D] (block_size a multiple of 16) and the chunk's
    keys are read in place from the blocks it names."""
    return ops().prompt_attention_bf16(q, k, v, count, scale, _engine_code(engine), context, block_table)


def decode_stack(num_heads: int, num_kv_heads: int, head_dim: int, eps: float, scale: float) -> object:
    """An empty C++ decode stack (decode_stack.cpp): add_layer(...) each layer, then forward(...) a step. A pybind
    class rather than an operator: it holds every layer's weights and runs a whole step on the list of page pairs;
    nothing in it is a unit the dispatcher or torch.compile could fuse or reorder."""
    return extension().DecodeStack(num_heads, num_kv_heads, head_dim, eps, scale)
