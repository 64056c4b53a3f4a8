"""Every limit and switch of the CPU kernel backend, in one frozen config. Defaults are the shipped choices; tests
and benches pass a `dataclasses.replace` of it to CpuKernelBackend. Figures behind each default:
docs/performance.md, under the bench command that measured it.

Which kernel serves a product of a given row count is a DispatchTable (engine/backends/dispatch.py): the engine's
builder measures one on the machine that runs it (`dispatch`); without one the row limits below make the shipped
table (`shipped_table`), as `--kernel-dispatch shipped` asks."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal, Mapping

from engine.backends.dispatch import ENGINES, FALLBACKS, PACKED, DispatchTable, Route
from engine.kernels.cpu_ext import KERNEL_MAX_PROMPT_TOKENS

MatrixEngine = Literal["auto", "tiles", "vectors"]


@dataclass(frozen=True)
class CpuKernelConfig:
    # Each constant below says which measurement backs it and on which kind of CPU (the figures: docs/performance.md,
    # under the bench command named). The row limits make the shipped dispatch table only: the engine's builder
    # measures the table on the machine that runs it (`dispatch`), unless --kernel-dispatch shipped.

    # Rows a product takes on the streaming GEMV (where no packed copy serves them: one row, or a few without one).
    # Backed by python -m bench.cpu_kernels --batches 1 on a Zen 5 EPYC (AVX-512 BF16, no AMX).
    max_gemv_rows: int = 5
    # Sequences of a decode group the in-place attention kernel takes (a verified sequence brings 1 + K rows).
    # Backed by python -m bench.cpu_kernels --batches 64 on a Zen 5 EPYC (AVX-512 BF16, no AMX).
    max_attention_seqs: int = 1 << 30
    # RMSNorm (+ residual add), RoPE, SiLU * up as one kernel each.
    # Backed by python -m bench.cpu_kernels --batches 1,8 (column elementwise) on a Zen 5 EPYC.
    fused_elementwise: bool = True
    # decode-only steps: the layers in one C++ call (off: the same kernels from Python).
    # Backed by python -m bench.cpu_kernels --batches 1,8 (column layers/all) on a Zen 5 EPYC.
    decode_stack: bool = True
    # Weights in 16x16-pair blocks where an engine runs them (off: oneDNN's packing).
    # Backed by python -m bench.tiled_linear on a Sapphire Rapids Xeon (AMX) and a Zen 5 EPYC.
    tiled_packing: bool = True
    # The MLP's gate|up product with SiLU * up off its results (needs the blocks), at every row count from 2.
    # Backed by python -m bench.tiled_linear (part 6) on a Sapphire Rapids Xeon (AMX).
    fused_gate_up: bool = True
    # The engine of the products on packed blocks: "auto" = tiles before vectors where both run (amx.h's order).
    matrix_engine: MatrixEngine = "auto"
    max_tiled_rows: int | None = None  # the packed blocks serve 2..this many rows; None: the engine's own limit
    # Backed by python -m bench.tiled_linear on a Sapphire Rapids Xeon (AMX): 2048-token steps keep F.linear.
    max_tiled_rows_tiles: int = 1024
    # Backed by python -m bench.tiled_linear on a Zen 5 EPYC (AVX-512 BF16, no AMX).
    max_tiled_rows_vectors: int = 4096

    # Rows a product on int8 weights takes on the int8 kernel (engine/kernels/int8_linear.cpp); more dequantise the
    # weight to bf16 for F.linear. Backed by python -m bench.weight_quant on a Zen 4 EPYC (AVX-512 VNNI, no AMX).
    max_int8_rows: int = 64
    # Of those rows, how many take the W8A8 kernel (x quantised to int8 in groups of 32, int32 sums on AVX-512 VNNI;
    # only where VNNI was built in), and how many rows of a product on int4 weights take the W4A8 kernel
    # (engine/kernels/int4_linear.cpp, the same activation format). 0 keeps them out of measured tables too.
    # Off by accuracy, not speed: int8 activations fail the accuracy gate (tests/test_kernel_accuracy.py) on the
    # real default model (python -m bench.kernel_accuracy --formats int4 --kernels w4a8, on a Zen 2 EPYC).
    max_w8a8_rows: int = 0
    max_w4a8_rows: int = 0
    # Rows a product on int4 weights takes on the weight-only int4 kernel (engine/kernels/int4_linear.cpp: the
    # nibbles widened to fp32 in registers, bf16 activations kept whole; past max_w4a8_rows); more dequantise the
    # weight to bf16 for F.linear. Backed by python -m bench.weight_quant on a Zen 2 EPYC (AVX2, no AVX-512).
    max_int4_rows: int = 64
    # Rows a product on int8g weights takes on its weight-only kernel (engine/kernels/int8_grouped.cpp); more
    # dequantise the weight to bf16 for F.linear. The int4 kernel's limit, taken over unmeasured (bench.weight_quant
    # has no int8g mode); a measured dispatch table times both int8g kernels on the model's own shapes.
    max_int8g_rows: int = 64

    # Which F.linear a table may name where no kernel of its own serves: "linear" (bf16) or "linear32" (fp32 on the
    # weight widened or dequantised to fp32, exact, rounded once to bf16). None: both, a measured table times them;
    # the shipped table takes linear32 where the CPU lacks bf16 dot products (AVX-512 BF16 or AMX). True: linear32
    # only; False: linear only. Backed by python -m bench.product_dtypes: on a Zen 3 EPYC (AVX2 only) torch's bf16
    # products ran at 0.3-19 GFLOP/s, fp32's (the weight widened in the call) at 67-138 from 32 rows; on an Intel
    # Xeon with AVX-512 but no BF16, bf16 at 41-63, fp32 at 42-308 from 8 rows.
    linear_fp32: bool | None = None

    # oneDNN's packed copy serves 2..this many rows.
    # Backed by python -m bench.tiled_linear (part 1) on a Sapphire Rapids Xeon (AMX).
    max_onednn_rows: int = 128
    # The row count oneDNN picks its blocking for. Backed by the same bench on the same Xeon.
    onednn_batch_hint: int = 64
    # Longer fresh prompts take SDPA: prompt_attention.cpp's own limit (one item's scores stay in L2).
    max_prompt_attention_tokens: int = KERNEL_MAX_PROMPT_TOKENS
    # Which kernel serves each format's row counts, measured on this machine; None: the shipped table of the limits.
    dispatch: DispatchTable | None = None

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
        if self.dispatch is not None and not isinstance(self.dispatch, DispatchTable):
            raise TypeError(f"CpuKernelConfig.dispatch must be a DispatchTable or None, not {self.dispatch!r}")
        if self.onednn_batch_hint < 1:
            raise ValueError("CpuKernelConfig.onednn_batch_hint must be >= 1")

    def candidates(self, available: Mapping[str, tuple[str, ...]],
                   engine: str | None) -> dict[str, tuple[str, ...]]:
        """Per format, the kernels a table may name here: those `available` (built with their vector code and running
        in this process), the packed blocks only on `engine` and only with tiled_packing, W8A8 and W4A8 only where
        their row limit is above 0 (int8 activations fail the accuracy gate: they run on request only), F.linear in
        bf16 and in fp32 as linear_fp32 allows."""
        def allowed(kernel: str) -> bool:
            if kernel in ENGINES:
                return self.tiled_packing and kernel == engine
            if kernel in FALLBACKS:
                return self.linear_fp32 is not (kernel == "linear")
            return {"w8a8": self.max_w8a8_rows, "w4a8": self.max_w4a8_rows}.get(kernel, 1) > 0
        return {fmt: tuple(k for k in kernels if allowed(k)) for fmt, kernels in available.items()}

    def row_caps(self) -> dict[str, int]:
        """The most rows a measured table may give W8A8 and W4A8 (their limits here are an accuracy choice), and the
        int4 GEMMs (int4_gemm, int4_bf16): max_int4_rows, as the weight-only kernel (past it the gate's KL bound
        failed on `auto`); int8g on bf16 dot products: max_int8g_rows, as its weight-only kernel."""
        return {"w8a8": min(self.max_w8a8_rows, self.max_int8_rows), "w4a8": self.max_w4a8_rows,
                "int4_gemm": self.max_int4_rows, "int4_bf16": self.max_int4_rows, "int8g_bf16": self.max_int8g_rows}

    def shipped_table(self, candidates: Mapping[str, tuple[str, ...]], native_bf16: bool) -> DispatchTable:
        """The table these row limits make among `candidates` (a `candidates` answer): on bf16 weights the packed
        copy (the engine's blocks, else oneDNN's) for 2..its limit, the GEMV up to max_gemv_rows, else F.linear; on
        int8 W8A8, then the int8 kernel; on int4 W4A8, then the weight-only kernel; on int8g its weight-only kernel;
        else the dequantised F.linear: in bf16 where the CPU has `native_bf16` dot products and linear_fp32 allows,
        else in fp32 (linear32)."""
        bf16, int8, int4 = candidates["bf16"], candidates["int8"], candidates["int4"]
        linear = "linear" if "linear" in bf16 and (native_bf16 or "linear32" not in bf16) else "linear32"
        packing = next((k for k in bf16 if k in PACKED), None)
        packed = 0 if packing is None else (
            self.engine_max_tiled_rows(packing) if packing in ENGINES else self.max_onednn_rows)
        gemv = self.max_gemv_rows if "gemv" in bf16 else 0
        w8a8 = min(self.max_w8a8_rows, self.max_int8_rows) if "w8a8" in int8 else 0
        int8_rows = self.max_int8_rows if "int8" in int8 else 0
        w4a8 = self.max_w4a8_rows if "w4a8" in int4 else 0
        int4_rows = self.max_int4_rows if "int4" in int4 else 0
        int8g_rows = self.max_int8g_rows if "int8g" in candidates.get("int8g", ()) else 0
        return DispatchTable(
            bf16=Route.from_rule(lambda r: packing if packing and 2 <= r <= packed else "gemv" if r <= gemv
                                 else linear, (packed, gemv)),
            int8=Route.from_rule(lambda r: "w8a8" if r <= w8a8 else "int8" if r <= int8_rows else linear,
                                 (w8a8, int8_rows)),
            int4=Route.from_rule(lambda r: "w4a8" if r <= w4a8 else "int4" if r <= int4_rows else linear,
                                 (w4a8, int4_rows)),
            int8g=Route.from_rule(lambda r: "int8g" if r <= int8g_rows else linear, (int8g_rows,)))

    def engine_max_tiled_rows(self, engine: str | None) -> int:
        """The most rows a product on the packed blocks takes on `engine` (0 where none runs them)."""
        if engine is None:
            return 0
        if self.max_tiled_rows is not None:
            return self.max_tiled_rows
        return self.max_tiled_rows_tiles if engine == "tiles" else self.max_tiled_rows_vectors
