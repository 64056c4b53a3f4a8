"""CPU kernels (C++, engine/kernels/cpu_ext.cpp) for the places where plain torch ops leave most of the machine
idle on a bf16 model: small-batch matrix-vector products, decode attention over paged KV, and the small
elementwise ops between the matrix products.

- `linear_bf16`: y = x W^T + b for a few rows. torch's bf16 GEMM reaches about 8 GB/s of weight traffic at
  one row on a 2-core AVX-512 host (its oneDNN kernels are built for large batches); this kernel streams
  each weight row once, widening bf16 to fp32 with a shift. Accumulation is fp32, as torch's; only the
  summation order differs.
- `decode_attention_bf16`: one query per row attends to its context read in place from the pages
  [num_blocks, block_size, kv_heads, head_dim] through its block table: no gather copy, no padding mask.
  Work items are (row, kv head) pairs, each with its whole query group, so a key/value row is loaded once for
  the group; at 8+ items a thread, threads claim whole items as they free up (engine/kernels/parallel.h),
  below that they get equal shares of all tokens (an item cut between two is merged from its softmax
  statistics). fp32 math from the bf16 inputs, one rounding of the output.
- `decode_attention_fp8`: the same over fp8 pages [num_blocks, page_bytes] (e4m3 codes | per-kv-head fp32
  scales), read in place instead of gathered and dequantised each step. A segment's key (then value) rows
  are decoded to bf16 (exact, subnormals and NaN included; a 128-entry table in 4 registers, 2 word permutes
  per 32 codes) and go through the bf16 kernel's steps; the page's power-of-two scale multiplies each score
  (keys) and probability weight (values), exactly. Decoding to fp32 by bit tricks instead measured 15-20%
  slower (it is the fp32 dot products, not the conversion, that cost); a 256-entry fp32 gather slower still.
  At 32 sequences x 512 tokens (SmolLM2 shapes) it runs ~1.5x the bf16 kernel's time: each 64-byte row of
  a 3084-byte page straddles two cache lines, so it moves as many lines as a bf16 row.
- `row_argmax_bf16`: the greedy pick on bf16 logits as they come out of the LM head, first maximal index (NaN
  first) as torch's max(dim); bf16 widens to fp32 exactly, so it is the pick of the fp32 logits too.
- `rms_norm` (with the residual add before it), `silu_mul` (on the fused gate|up output), `rotary_` (q and k
  in place in the fused qkv output): one pass each instead of 3-10 torch ops and their temporaries. They round
  every intermediate to bf16 where the torch ops store one, so they match torch to the bit but for rare
  one-ulp flips (RMSNorm's fp32 sum order, SiLU's exp).
- `tiled_linear` (engine/kernels/tiled_linear.cpp): bf16 products on weights packed once into 16x16-pair
  blocks (AMX's tile order), for decode batches and prefill chunks (2..packed_linear.max_tiled_rows() rows), on
  one of two engines (`matrix_engines`): AMX tiles, or AVX-512 BF16 vectors where the CPU has no AMX (AMD Zen
  4/5). It streams the weights once (per ~1 MiB slice of rows) and prefetches ahead, where oneDNN's packed
  matmul read them at 7-11 GB/s on the AMX host and ran at 670 GFLOPS at 64 rows on the Zen 5 one (the vectors:
  860) (engine/kernels/packed_linear.py has the figures). `tiled_linear_argmax` is the same product reduced to
  each row's argmax as the results come out: a greedy step neither writes nor rereads the [rows, vocab]
  logits. `tiled_linear_silu_mul` is the MLP's gate|up product with SiLU(gate) * up computed as its results
  come out, for any number of rows (figures in packed_linear.py).
- `prompt_attention` (engine/kernels/prompt_attention.cpp): causal attention of whole fresh prompts (no cached
  context), `count` prompts of one length in one call: scores and the product with V on AMX tiles, or on
  AVX-512 BF16 vectors where the CPU has no AMX (AMD Zen 4/5), softmax in fp32, probabilities rounded to bf16
  as torch's flash attention rounds them. Against torch's SDPA from 128 prompts of 16 tokens to one of 2048
  (python -m bench.prompt_attention): tiles 1.3-2.6x, vectors 3.7-6.5x (that CPU's SDPA is slower). Chunks
  after cached context keep SDPA.
- `DecodeStack` (engine/kernels/decode_stack.cpp): the decoder layers of a decode-only step in one call, the
  ops above and the packed products in the order the Python layers run them (bit-identical hidden states),
  without the interpreter between them; LlamaModel.forward takes it where it applies.

All run on torch's intra-op thread pool (at::parallel_for). A first version in Numba lost most of its
isolated speed-up inside the model: Numba brings its own OpenMP runtime, whose threads and torch's took
turns on the same two cores. The extension is compiled on first use (torch cpp_extension, cached under
TORCH_EXTENSIONS_DIR, ~1 minute once per machine); without a compiler the engine runs plain torch ops, and
built without AVX-512 only the GEMV is used (the scalar fallbacks of the others lose to torch).
"""
from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name(name) for name in ("cpu_ext.cpp", "decode_stack.cpp", "tiled_linear.cpp", "prompt_attention.cpp")]
HEADERS = [Path(__file__).with_name(name) for name in ("amx.h", "parallel.h", "vec.h")]
# Where the kernels measured faster than torch inside the SmolLM2 forward (python -m bench.cpu_kernels,
# 2 cores): rows of a product, sequences of a decode group.
# GEMV (min of 10 forwards, ctx 192 / 1024): at one row torch 52.0 / 57.8 ms, GEMV 37.8 / 43.3; at 4-5 rows
# (a verification chunk of 1 + K=4 drafts) the GEMV still wins by 5-10% (each weight vector is widened once
# for all rows); at 8 it breaks even. Where the weights have a oneDNN-packed copy (engine/kernels/packed_linear.py,
# the usual case) that copy serves 2+ rows and the GEMV only one row (GEMV 10-30% faster than it there).
# Attention and elementwise kernels: faster at every batch measured, 1 to 64 sequences. Min of 8 forwards,
# ctx 192 / 1024, torch ops -> attention kernel alone: batch 1 38.1 -> 33.2 / 64.5 -> 57.6 ms, batch 64
# 106.0 -> 76.5 / 357.0 -> 162.8 (no gather, no padded SDPA); elementwise kernels alone: 10-15% at ctx 192;
# all kernels as an engine runs them: batch 1 23.1 / 31.4, batch 64 63.6 / 150.2.
# Noisy host: the ratios held across runs, the absolute times did not.
MAX_GEMV_ROWS = 5
MAX_PROMPT_ATTENTION_TOKENS = 8192  # the kernel's own limit (prompt_attention.cpp): one item's scores stay in L2
MAX_ATTENTION_SEQS = 1 << 30  # sequences in a decode group (a verified sequence brings 1 + K rows): no limit
FUSED_ELEMENTWISE = True  # RMSNorm (+ residual add), RoPE, SiLU * up
DECODE_STACK = True  # decode-only steps: the layers in one C++ call (off: the same kernels from Python)


@functools.cache
def extension() -> ModuleType | None:
    """The compiled module, built once per process (and once per machine on disk); None if it cannot be."""
    from torch.utils.cpp_extension import load

    log.info("loading the CPU kernels (built once per machine: about a minute the first time)")
    try:
        # -fopenmp: at::parallel_for is inline OpenMP; without it the kernels ran on one thread. The
        # extension then binds to the libgomp torch already loaded (same soname): one pool for both.
        return load(name="phase_serve_cpu_ext", sources=[str(s) for s in SOURCES],
                    extra_cflags=["-O3", "-march=native", "-fopenmp", f"-DCPU_EXT_HEADERS={_headers_digest()}"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # noqa: BLE001 - no compiler, no headers: fall back to torch ops
        log.warning("CPU kernels unavailable (%s); running plain torch ops", str(exc).splitlines()[0][:200])
        return None


def _headers_digest() -> str:
    """A digest of our headers: torch rebuilds a cached extension only when its sources or flags change, so
    the headers' content goes into the flags."""
    return hashlib.sha1(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:16]


def available() -> bool:
    return extension() is not None


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear_bf16` is the faster choice for this product."""
    return (x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and x.is_cpu
            and x.dim() == 2 and x.shape[0] <= MAX_GEMV_ROWS and weight.is_contiguous())


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] bf16, weight [N, K] bf16 (contiguous), bias [N] -> [M, N] bf16, rounded once from fp32."""
    return extension().linear_bf16(x, weight, bias if bias is not None else torch.empty(0))


def attention_applies(num_seqs: int) -> bool:
    """Whether `decode_attention_bf16` is the faster choice for a decode group of `num_seqs` sequences."""
    return num_seqs <= MAX_ATTENTION_SEQS and vectorized()


def decode_attention_bf16(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                          block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, D] bf16; pages [num_blocks, bs, Hkv, D] bf16; block_tables [B, nb] int64 (entries and slots
    past a row's context are never read); context_lens [B] int64 (>= 1) -> [B, Hq, D] bf16."""
    return extension().decode_attention_bf16(q, k_pages, v_pages, block_tables, context_lens, scale)


def decode_attention_fp8(q: torch.Tensor, k_raw: torch.Tensor, v_raw: torch.Tensor, scale_offset: int,
                         block_size: int, kv_heads: int, head_dim: int, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, D] bf16; k_raw/v_raw [num_blocks, page_bytes] uint8 fp8 pages (engine/kv_formats.py: codes
    [bs, Hkv, D] e4m3 at byte 0, scales [Hkv] fp32 at byte `scale_offset`), read in place; block_tables
    [B, nb] int64 (entries and slots past a row's context are never read); context_lens [B] int64 (>= 1)
    -> [B, Hq, D] bf16."""
    return extension().decode_attention_fp8(q, k_raw, v_raw, scale_offset, block_size, kv_heads, head_dim,
                                            block_tables, context_lens, scale)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x [B, V] -> [B] int64, x.max(dim=-1).indices: bf16 logits read in place by the kernel (no fp32 copy of
    [B, V]: at 64 x 49152 the copy and the fp32 max took ~5 ms of a ~80 ms step), anything else by torch."""
    if x.dtype == torch.bfloat16 and x.is_cpu and x.dim() == 2 and x.stride(1) == 1 and x.shape[1] and available():
        return extension().row_argmax_bf16(x)
    return x.max(dim=-1).indices


def elementwise_applies(x: torch.Tensor) -> bool:
    """Whether the fused elementwise kernels take this activation: bf16 [T, width] on the CPU, unit stride."""
    return (FUSED_ELEMENTWISE and x.dtype == torch.bfloat16 and x.is_cpu and x.dim() == 2
            and x.stride(1) == 1 and vectorized())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] bf16 -> (RMSNorm(s) [T, H], s) with s = residual + x (s = x without a residual), each rounded
    to bf16 where the torch ops round."""
    return tuple(extension().rms_norm_bf16(x, torch.empty(0) if residual is None else residual, weight, eps))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] bf16 (gate | up) -> silu(gate) * up [T, I] bf16."""
    return extension().silu_mul_bf16(gate_up)


def rotary_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, head_dim: int) -> None:
    """Rotates the first `heads` heads of each row of qkv [T, >= heads * D] bf16 in place (half-split layout);
    cos, sin [T, 1, D/2] (or [T, D/2]) bf16, as RotaryEmbedding.lookup returns them."""
    extension().rotary_bf16_(qkv, cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1), heads, head_dim)


MATRIX_ENGINES = ("auto", "tiles", "vectors")  # the kernels' engine codes 0, 1, 2 (amx.h)


@functools.cache
def matrix_engines() -> tuple[str, ...]:
    """The engines of the products on packed blocks here, fastest first: "tiles" (AMX; -march=native on a CPU
    that has it, and the tile state granted by the kernel), "vectors" (AVX-512 BF16). `tiled_linear*` and
    `prompt_attention` run on either; "auto" takes the first."""
    if not available():
        return ()
    return tuple(MATRIX_ENGINES[code] for code in extension().matrix_engines())


def tiled_available() -> bool:
    """Whether `tile_pack`, `tiled_linear*` and `prompt_attention` run here (on either engine)."""
    return bool(matrix_engines())


def _engine_code(engine: str) -> int:
    if engine not in MATRIX_ENGINES:
        raise ValueError(f"engine must be one of {MATRIX_ENGINES}, not {engine!r}")
    return MATRIX_ENGINES.index(engine)


def tile_pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] bf16 (N % 16 == 0, K % 32 == 0) -> 16x16-pair blocks [N/16, K/32, 16, 32] for `tiled_linear`."""
    return extension().tile_pack_bf16(weight)


def tiled_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
                 engine: str = "auto") -> torch.Tensor:
    """x [M, K] bf16, packed from `tile_pack` -> [M, N] bf16 = x W^T + b, fp32 sums rounded once."""
    return extension().tiled_linear_bf16(x, packed, bias if bias is not None else torch.empty(0), _engine_code(engine))


def tiled_linear_silu_mul(x: torch.Tensor, packed: torch.Tensor, engine: str = "auto") -> torch.Tensor:
    """x [M, K] bf16, packed: `tile_pack` of a gate|up weight [2I, K] with its 16-row blocks interleaved (gate
    block j, then up block j; packed_linear.pack_gate_up) -> silu(gate) * up [M, I] bf16, silu_mul of the plain
    product to the bit, without writing the [M, 2I] product."""
    return extension().tiled_linear_silu_mul_bf16(x, packed, _engine_code(engine))


def prompt_attention_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int) -> bool:
    """Whether `prompt_attention` takes these views: bf16 on the CPU, head_dim a multiple of 32, prompts of at
    most MAX_PROMPT_ATTENTION_TOKENS, heads and dims contiguous in each row (the fused qkv's views are)."""
    rows, _, head_dim = q.shape
    return (q.dtype == torch.bfloat16 and q.is_cpu and head_dim % 32 == 0
            and rows // count <= MAX_PROMPT_ATTENTION_TOKENS
            and all(x.dtype == q.dtype and x.stride(2) == 1 and x.stride(1) == head_dim and x.stride(0) % 2 == 0
                    for x in (q, k, v))
            and tiled_available())


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int, scale: float,
                     engine: str = "auto") -> torch.Tensor:
    """q [count * S, Hq, D], k/v [count * S, Hkv, D] bf16: `count` whole prompts of S tokens, one after another
    -> [count * S, Hq, D] bf16, each prompt attending causally to itself (no cached context). engine: "auto"
    (the first of `matrix_engines`), "tiles" or "vectors"."""
    return extension().prompt_attention_bf16(q, k, v, count, scale, _engine_code(engine))


def tiled_linear_argmax(x: torch.Tensor, packed: torch.Tensor, engine: str = "auto") -> torch.Tensor:
    """x [M, K] bf16 (M >= 1), packed from `tile_pack` -> [M] int64 = row_argmax(tiled_linear(x, packed)), without
    writing the [M, N] product: the greedy pick straight off the LM head."""
    return extension().tiled_linear_argmax_bf16(x, packed, _engine_code(engine))


@functools.cache
def vectorized() -> bool:
    """Whether the extension was built with its AVX-512 paths (its scalar fallbacks lose to torch)."""
    return available() and extension().vectorized()


def main() -> int:
    """Build (or load) the extension and report; exit status 1 when it cannot be built."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return 0 if available() else 1
