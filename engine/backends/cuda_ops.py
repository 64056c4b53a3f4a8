"""The CUDA backend: plain torch products (cuBLAS), paged attention read in place by Triton kernels
(engine/backends/triton_attention.py) or FlashInfer's decode kernel, KV writes that skip padding rows, and the
elementwise work (RMSNorm, add + RMSNorm, RoPE, SiLU * up, the sampler's dense distribution) as one
torch.compile'd kernel each.

Its decode step on plain pages issues no host sync and launches grids fixed by the row count, so the engine
captures it as CUDA graphs (`captures_decode`, engine/core/cuda_graphs.py). Building it touches no GPU (the
processor count and FlashInfer's workspace are read on first use), so the selection is tested with the device
faked, and its attention runs on CPU tensors under TRITON_INTERPRET=1.
"""
from __future__ import annotations

import logging
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F

from engine.backends.base import Rope
from engine.backends.gpu_config import GpuConfig
from engine.backends.torch_ops import TorchBackend, apply_rotary, split_heads
from engine.backends.weight_ops import Weight

if TYPE_CHECKING:
    from engine.backends.attention import AttentionMetadata

log = logging.getLogger(__name__)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual = residual + x
    return _rms_norm(residual, weight, eps), residual


def _rotate_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class CompiledOps:
    """Elementwise functions compiled by torch.compile on first call (dynamic in the row count: one compile serves
    every batch); where compiling fails, the plain function from then on, with one warning. Off: plain always."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.compiled: dict[Callable, Callable] = {}

    def __call__(self, fn: Callable, *args: Any) -> Any:
        if not self.enabled:
            return fn(*args)
        runner = self.compiled.get(fn)
        if runner is not None:
            return runner(*args)
        try:
            runner = torch.compile(fn, dynamic=True)
            result = runner(*args)
        except Exception as exc:  # a compiler the machine lacks, an op inductor cannot lower: plain torch serves
            log.warning("torch.compile of %s failed (%s: %s); it runs as plain torch ops", fn.__name__,
                        type(exc).__name__, exc)
            runner, result = fn, fn(*args)
        self.compiled[fn] = runner
        return result


class CudaBackend(TorchBackend):
    name = "cuda"
    attends_in_place = True

    def __init__(self, device: torch.device | str = "cuda", config: GpuConfig = GpuConfig(),
                 processors: int | None = None) -> None:
        """`config.attention` is resolved already ("triton" or "flashinfer", engine/backends/select.py);
        `processors`: the device's streaming multiprocessors (None: read from the device on first use)."""
        super().__init__(device)
        from engine.backends import triton_attention  # here: a CPU engine never imports Triton

        self.kernels = triton_attention
        self.config = config
        self.ops = CompiledOps(config.compile_elementwise)
        self.flashinfer = self._flashinfer() if config.attention == "flashinfer" else None
        if processors is not None:
            self.processors = processors

    def _flashinfer(self) -> object:
        import flashinfer  # the optional extra; select.py checked that it imports

        from engine.backends.flashinfer_attention import FlashInferDecode
        return FlashInferDecode(flashinfer, self.device)

    @property
    def captures_decode(self) -> bool:
        """FlashInfer plans every step on the host: its steps run eagerly."""
        return self.flashinfer is None

    @cached_property
    def processors(self) -> int:
        return torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" \
            else 1

    # ---- elementwise ----------------------------------------------------------------------------------------

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.ops(_rms_norm, x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops(_add_rms_norm, x, residual, weight, eps)

    def rotary(self, qkv: torch.Tensor, rope: Rope, num_heads: int, num_kv_heads: int,
               head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = split_heads(qkv, num_heads, num_kv_heads, head_dim)
        q, k = self.ops(_rotate_qk, q, k, *rope)
        return q, k, v

    def gate_up_silu(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        return self.ops(_silu_mul, self.linear(x, w))

    def fuse(self, fn: Callable[..., Any]) -> Callable[..., Any] | None:
        return partial(self.ops, fn) if self.config.compile_elementwise else None

    # ---- paged attention ------------------------------------------------------------------------------------

    def write_kv(self, cache: object, x: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
        """Plain pages only (a quantised page is re-encoded whole: engine/kv/formats.py)."""
        if not isinstance(cache, torch.Tensor) or self.kernels.page_source(cache) is None:
            return False
        self.kernels.store_kv(x, cache, slot_mapping)
        return True

    def decode_attention(self, q: torch.Tensor, k_cache: object, v_cache: object, meta: AttentionMetadata,
                         scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor | None:
        k, v = self.kernels.page_source(k_cache), self.kernels.page_source(v_cache)
        if k is None or v is None or k.layout() != v.layout():
            return None
        if self.flashinfer is not None and not k.fp8:
            return self.flashinfer.decode(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                                          meta.kernel_inputs, scale, window, softcap)
        splits = self.kernels.decode_splits(len(q), k.kv_heads, self.processors, self.config.max_splits)
        return self.kernels.decode_attention(q, k, v, meta.decode_block_tables, meta.decode_context_lens, scale,
                                             window, softcap, splits)

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: object,
                          v_cache: object, meta: AttentionMetadata, scale: float, out: torch.Tensor,
                          window: int | None = None, softcap: float | None = None) -> bool:
        """Plain pages: every segment in one launch, its keys read from the pages (written this step). fp8 pages:
        the fresh segments from their own unquantised keys (as the reference attends to them), the others from
        the pages, one launch each."""
        ks, vs = self.kernels.page_source(k_cache), self.kernels.page_source(v_cache)
        if ks is None or vs is None or ks.layout() != vs.layout():
            return False
        for from_pages, segments in self._segments(meta, q.device, ks.fp8):
            k_src, v_src = (ks, vs) if from_pages else (self.kernels.dense_source(k), self.kernels.dense_source(v))
            self.kernels.prefill_attention(q, out, k_src, v_src, segments, scale, window, softcap)
        return True

    def _segments(self, meta: AttentionMetadata, device: torch.device, split_fresh: bool) -> list:
        """[(read from the pages, Segments)], built once a step (meta.kernel_inputs)."""
        key = ("triton segments", split_fresh)
        if key not in meta.kernel_inputs:
            groups: dict[bool, tuple[list, list]] = {}
            for seg in meta.prefills:
                from_pages = not split_fresh or seg.context_start > 0
                rows, tables = groups.setdefault(from_pages, ([], []))
                rows.append((seg.start, seg.context_start, seg.length, 0 if from_pages else seg.start))
                tables.append(seg.block_table if from_pages else torch.zeros(1, dtype=torch.long))
            meta.kernel_inputs[key] = [(from_pages, self.kernels.Segments.build(rows, tables, device))
                                       for from_pages, (rows, tables) in groups.items()]
        return meta.kernel_inputs[key]

    def describe(self) -> dict[str, Any]:
        kernels = ["triton_paged_attention", "triton_store_kv"]
        if self.flashinfer is not None:
            kernels.append("flashinfer_decode")
        if self.config.compile_elementwise:
            kernels.append("compiled_elementwise")
        return {"backend": self.name, "device": str(self.device), "matrix_engine": None, "kernels": kernels,
                "build_key": None, "captures_decode": self.captures_decode}
