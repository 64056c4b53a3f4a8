"""Every limit and switch of the CPU kernel backend, in one frozen config. Defaults are the shipped choices; tests
and benches pass a `dataclasses.replace` of it to CpuKernelBackend. Figures behind each default:
docs/performance.md, under the bench command that measured it."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from engine.kernels.cpu_ext import KERNEL_MAX_PROMPT_TOKENS

MatrixEngine = Literal["auto", "tiles", "vectors"]


@dataclass(frozen=True)
class CpuKernelConfig:
    # Rows a product takes on the streaming GEMV (where no packed copy serves them: one row, or a few without one).
    # Kept: a batch-1 forward takes 0.59x torch's time with it alone (python -m bench.cpu_kernels --batches 1).
    max_gemv_rows: int = 5
    # Sequences of a decode group the in-place attention kernel takes (a verified sequence brings 1 + K rows).
    # Kept: a batch-64 forward takes 0.74x torch's time with it alone (python -m bench.cpu_kernels --batches 64).
    max_attention_seqs: int = 1 << 30
    # RMSNorm (+ residual add), RoPE, SiLU * up as one kernel each. Kept: 0.75x torch's forward time at batch 8,
    # 0.88x at 1 (python -m bench.cpu_kernels --batches 1,8, column elementwise).
    fused_elementwise: bool = True
    # decode-only steps: the layers in one C++ call (off: the same kernels from Python). The Python loop took
    # 1.31-1.42x the stack's time at batch 1-8 (python -m bench.cpu_kernels --batches 1,8, column layers/all).
    decode_stack: bool = True
    tiled_packing: bool = True  # weights in 16x16-pair blocks where an engine runs them (off: oneDNN's packing)
    fused_gate_up: bool = True  # the MLP's gate|up product with SiLU * up off its results (needs the blocks)
    matrix_engine: MatrixEngine = "auto"  # the engine of the products on packed blocks: "auto" = the fastest here
    max_tiled_rows: int | None = None  # the packed blocks serve 2..this many rows; None: the engine's own limit
    max_tiled_rows_tiles: int = 1024  # AMX tiles: the 2048-token offline steps keep F.linear
    max_tiled_rows_vectors: int = 4096  # AVX-512 BF16: every step up to 4096 tokens

    # Rows a product on int8 weights takes on the int8 kernel (engine/kernels/int8_linear.cpp); more dequantise the
    # weight to bf16 for F.linear. Kept: int8 batch-1 decode 1.31-1.48x bf16's tok/s (python -m bench.weight_quant).
    max_int8_rows: int = 64
    # Of those rows, how many take the W8A8 kernel (x quantised to int8 in groups of 32, int32 sums on AVX-512 VNNI;
    # only where VNNI was built in), and how many rows of a product on int4 weights take the W4A8 kernel
    # (engine/kernels/int4_linear.cpp, the same activation format); more dequantise the weight to bf16 for F.linear.
    # Off by default: int8 activations fail the accuracy gate (tests/test_kernel_accuracy.py) on the real default
    # model: W4A8 against the same int4 weights with bf16 activations, top-1 0.952 and KL mean 0.0086
    # (python -m bench.kernel_accuracy --formats int4 --kernels w4a8). The int8 and int4 weights then meet bf16 activations.
    max_w8a8_rows: int = 0
    max_w4a8_rows: int = 0
    # Rows a product on int4 weights takes on the weight-only int4 kernel (engine/kernels/int4_linear.cpp: the
    # nibbles widened to fp32 in registers, bf16 activations kept whole; past max_w4a8_rows); more dequantise the
    # weight to bf16 for F.linear. Its speed, and 64 as the limit to give it: docs/performance.md, "The weight-only
    # int4 kernel".
    max_int4_rows: int = 64

    max_onednn_rows: int = 128  # oneDNN's packed copy serves 2..this many rows
    onednn_batch_hint: int = 64  # the row count oneDNN picks its blocking for
    max_prompt_attention_tokens: int = KERNEL_MAX_PROMPT_TOKENS  # longer fresh prompts take SDPA

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int) and not isinstance(value, bool) and value < 0:
                raise ValueError(f"CpuKernelConfig.{f.name} must be >= 0, not {value}")
        if self.matrix_engine not in ("auto", "tiles", "vectors"):
            raise ValueError(f"CpuKernelConfig.matrix_engine must be auto, tiles or vectors, "
                             f"not {self.matrix_engine!r}")
        if self.max_prompt_attention_tokens > KERNEL_MAX_PROMPT_TOKENS:
            raise ValueError(f"CpuKernelConfig.max_prompt_attention_tokens: the kernel takes at most "
                             f"{KERNEL_MAX_PROMPT_TOKENS}, not {self.max_prompt_attention_tokens}")
        if self.onednn_batch_hint < 1:
            raise ValueError("CpuKernelConfig.onednn_batch_hint must be >= 1")

    def engine_max_tiled_rows(self, engine: str | None) -> int:
        """The most rows a product on the packed blocks takes on `engine` (0 where none runs them)."""
        if engine is None:
            return 0
        if self.max_tiled_rows is not None:
            return self.max_tiled_rows
        return self.max_tiled_rows_tiles if engine == "tiles" else self.max_tiled_rows_vectors
