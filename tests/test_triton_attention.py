"""The Triton paged-attention kernels (engine/backends/triton_attention.py) against the torch reference
(engine/backends/attention.py) on random paged layouts: ragged lengths, contexts ending on and just past block
boundaries, GQA ratios (including one that is not a power of two), sliding windows, soft-caps, prefix hits and
chunked prefill, context splits, fp32, fp16 and fp8 pages; and through the CUDA backend's hooks. On the CPU they
run in Triton's interpreter (tests/triton_interpreter.py), on a GPU compiled."""
from __future__ import annotations

import pytest
import torch

from engine.backends import attention
from engine.backends.attention import AttentionMetadata, paged_attention
from engine.backends.gpu_config import GpuConfig
from engine.kernels import dequantize_fp8
from engine.kv.formats import PageWrites, QuantizedPages, page_format
from tests.triton_interpreter import DEVICE, kernels

ta = kernels()
from engine.backends.cuda_ops import CudaBackend  # noqa: E402  (after the kernels: the backend imports them)

BLOCK, HEAD_DIM, NUM_BLOCKS = 4, 16, 48
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3}
F32, F16 = torch.float32, torch.float16
# The interpreter runs each program in Python, so the cases are few and small, each dtype on its share of them.


def random_tables(lengths: list[int], gen: torch.Generator) -> list[list[int]]:
    """Each context on its own blocks, drawn at random from the pool: neighbours in a table are not neighbours
    in memory."""
    ids = iter(torch.randperm(NUM_BLOCKS, generator=gen).tolist())
    return [[next(ids) for _ in range(-(-n // BLOCK))] for n in lengths]


def pages(kv_heads: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (NUM_BLOCKS, BLOCK, kv_heads, HEAD_DIM)
    k, v = (torch.randn(shape, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
    return k, v


def fp8_pages(kv_heads: int, dtype: torch.dtype, gen: torch.Generator) -> tuple[QuantizedPages, QuantizedPages]:
    """Every slot of an fp8 pool written (page scales from values of mixed magnitudes)."""
    fmt = page_format("fp8", BLOCK, kv_heads, HEAD_DIM)
    raw = torch.zeros(2, NUM_BLOCKS, fmt.page_bytes, dtype=torch.uint8, device=DEVICE)
    plan = PageWrites.build(torch.arange(NUM_BLOCKS * BLOCK, device=DEVICE), BLOCK)
    caches = []
    for i in range(2):
        cache = QuantizedPages(raw[i], fmt, dtype)
        magnitudes = torch.rand(NUM_BLOCKS * BLOCK, 1, 1, generator=gen) * 8
        values = torch.randn(NUM_BLOCKS * BLOCK, kv_heads, HEAD_DIM, generator=gen) * magnitudes
        cache.write(plan, values.to(dtype).to(DEVICE))
        caches.append(cache)
    return caches[0], caches[1]


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """Within a few of the dtype's steps, relative to the values' size (fp8 pages' values reach about 10)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    err = ((got.float() - want.float()).abs() / (1 + want.float().abs())).max().item()
    assert err <= TOLERANCE[dtype], err


DECODE_CASES = {  # lengths (on, before and past block ends), kv heads, group, window, softcap, splits, dtypes
    "ragged": ([1, 4, 5, 8, 13, 31], 2, 3, None, None, 1, (F32, F16)),
    "split": ([1, 4, 9, 40], 1, 4, None, None, 4, (F32,)),
    "window": ([3, 6, 7, 17, 33], 2, 2, 6, None, 2, (F16,)),
    "softcap": ([2, 12, 20], 2, 1, None, 2.5, 1, (F32,)),
    "window+softcap+split": ([1, 16, 29], 1, 8, 9, 4.0, 4, (F32, F16)),
}


@pytest.mark.parametrize("case,dtype", [(c, d) for c, spec in DECODE_CASES.items() for d in spec[-1]], ids=str)
def test_decode_kernel_matches_the_reference(case, dtype):
    lengths, kv_heads, group, window, softcap, splits, _ = DECODE_CASES[case]
    gen = torch.Generator().manual_seed(list(DECODE_CASES).index(case))
    k_cache, v_cache = pages(kv_heads, dtype, gen)
    meta = AttentionMetadata.build(BLOCK, list(zip(random_tables(lengths, gen), lengths)), [], device=DEVICE)
    q = torch.randn(len(lengths), kv_heads * group, HEAD_DIM, generator=gen).to(dtype).to(DEVICE)
    want = attention._decode_attention(q, k_cache, v_cache, meta, 0.3, window, softcap)
    got = ta.decode_attention(q, ta.page_source(k_cache), ta.page_source(v_cache), meta.decode_block_tables,
                              meta.decode_context_lens, 0.3, window, softcap, splits=splits, block_n=32)
    close(got, want, dtype)


def test_splits_change_nothing_but_the_order_of_sums():
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = pages(1, torch.float32, gen)
    lengths = [7, 100]
    meta = AttentionMetadata.build(BLOCK, list(zip(random_tables(lengths, gen), lengths)), [], device=DEVICE)
    q = torch.randn(2, 2, HEAD_DIM, generator=gen).to(DEVICE)
    args = (q, ta.page_source(k_cache), ta.page_source(v_cache), meta.decode_block_tables, meta.decode_context_lens,
            0.25)
    one, eight = ta.decode_attention(*args, splits=1, block_n=64), ta.decode_attention(*args, splits=8, block_n=16)
    close(eight, one, torch.float32)


def test_a_padding_row_of_length_zero_gives_zeros_and_reads_nothing():
    gen = torch.Generator().manual_seed(4)
    k_cache, v_cache = pages(1, torch.float32, gen)
    tables = torch.tensor([[3, 9], [10 ** 9, 10 ** 9]], device=DEVICE)  # the padding row's table points nowhere
    lens = torch.tensor([6, 0], device=DEVICE)
    q = torch.randn(2, 2, HEAD_DIM, generator=gen).to(DEVICE)
    for splits in (1, 2):
        out = ta.decode_attention(q, ta.page_source(k_cache), ta.page_source(v_cache), tables, lens, 0.3,
                                  splits=splits, block_n=16)
        assert torch.equal(out[1], torch.zeros_like(out[1])) and out[0].abs().sum() > 0


PREFILL_CASES = {  # (context_start, length) per segment, kv heads, group, window, softcap, dtypes
    "fresh+chunks": ([(0, 7), (5, 9), (12, 3), (0, 1)], 1, 2, None, None, (F32, F16)),
    "prefix hits": ([(8, 6), (4, 1), (16, 11)], 1, 3, None, None, (F32,)),  # cached prefixes of whole blocks
    "window": ([(0, 13), (9, 10)], 2, 1, 5, None, (F16,)),
    "softcap+window": ([(0, 9), (6, 12)], 1, 2, 7, 3.0, (F32,)),
}


@pytest.mark.parametrize("case,dtype", [(c, d) for c, spec in PREFILL_CASES.items() for d in spec[-1]], ids=str)
def test_prefill_kernel_matches_the_reference(case, dtype):
    """Every segment in one launch, keys from the pages (the step's own written first, as paged_attention does),
    query tiles (8 rows) and key tiles (16) cutting across segments' blocks."""
    segs, kv_heads, group, window, softcap, _ = PREFILL_CASES[case]
    gen = torch.Generator().manual_seed(list(PREFILL_CASES).index(case))
    k_cache, v_cache = pages(kv_heads, dtype, gen)
    tables = random_tables([c + n for c, n in segs], gen)
    meta = AttentionMetadata.build(BLOCK, [], [(t, c, n) for t, (c, n) in zip(tables, segs)], device=DEVICE)
    rows = sum(n for _, n in segs)
    q, k, v = (torch.randn(rows, h, HEAD_DIM, generator=gen).to(dtype).to(DEVICE)
               for h in (kv_heads * group, kv_heads, kv_heads))
    want = paged_attention(q, k, v, k_cache, v_cache, meta, 0.3, None, window, softcap)
    segments = ta.Segments.build([(s.start, s.context_start, s.length, 0) for s in meta.prefills],
                                 [s.block_table for s in meta.prefills], DEVICE)
    got = torch.zeros_like(q)
    ta.prefill_attention(q, got, ta.page_source(k_cache), ta.page_source(v_cache), segments, 0.3, window, softcap,
                         block_m=8, block_n=16)
    close(got, want, dtype)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the NaN code, in the interpreter
def test_fp8_codes_decode_as_the_quantiser_decodes_them():
    """E4M3 codes (a subnormal, normals of both signs, NaN) in one page under a scale, each read alone by the
    decode kernel (a window of one key, the context ending on it) against dequantize_fp8 of the same codes."""
    fmt = page_format("fp8", 256, 1, HEAD_DIM)
    codes = torch.arange(256, dtype=torch.uint8).repeat_interleave(HEAD_DIM).view(1, 256, 1, HEAD_DIM)
    scales = torch.tensor([[0.5]])
    raw = torch.zeros(2, 1, fmt.page_bytes, dtype=torch.uint8)
    for i in range(2):
        raw[i, 0, :256 * HEAD_DIM] = codes.flatten()
        raw[i, 0, fmt.fields[1].offset:fmt.fields[1].offset + 4] = scales.view(torch.uint8).flatten()
    keys = QuantizedPages(raw[0].to(DEVICE), fmt, torch.float32)
    want = dequantize_fp8(codes, scales, dtype=torch.float32)[0, :, 0]  # [256, D]
    got = torch.stack([ta.decode_attention(torch.zeros(1, 1, HEAD_DIM, device=DEVICE), ta.page_source(keys),
                                           ta.page_source(QuantizedPages(raw[1].to(DEVICE), fmt, torch.float32)),
                                           torch.zeros(1, 1, dtype=torch.long, device=DEVICE),
                                           torch.tensor([n + 1], device=DEVICE), 1.0, window=1)[0, 0]
                       for n in range(0, 256, 51)]).cpu()  # the window keeps the last key alone: its value
    picked = want[0:256:51]
    assert torch.equal(torch.isnan(got), torch.isnan(picked))
    assert torch.equal(got.nan_to_num(), picked.nan_to_num())


@pytest.mark.parametrize("dtype", [F16], ids=str)
def test_fp8_pages_are_read_in_place_as_the_reference_dequantises_them(dtype):
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = fp8_pages(2, dtype, gen)
    lengths = [1, 8, 26]
    meta = AttentionMetadata.build(BLOCK, list(zip(random_tables(lengths, gen), lengths)), [], device=DEVICE)
    q = torch.randn(3, 6, HEAD_DIM, generator=gen).to(dtype).to(DEVICE)
    want = attention._decode_attention(q, k_cache, v_cache, meta, 0.3)
    got = ta.decode_attention(q, ta.page_source(k_cache), ta.page_source(v_cache), meta.decode_block_tables,
                              meta.decode_context_lens, 0.3, splits=2, block_n=8)
    close(got, want, dtype)


def test_store_skips_padding_slots_and_writes_the_rest_as_index_copy_does():
    gen = torch.Generator().manual_seed(6)
    cache, _ = pages(2, torch.float16, gen)
    x = torch.randn(5, 2, HEAD_DIM, generator=gen).to(torch.float16).to(DEVICE)
    slots = torch.tensor([7, -1, 0, 130, -1], device=DEVICE)
    want = cache.clone()
    want.view(-1, 2, HEAD_DIM).index_copy_(0, slots[slots >= 0], x[slots >= 0])
    ta.store_kv(x[:, :, :], cache, slots)
    assert torch.equal(cache, want)


def backend() -> CudaBackend:
    return CudaBackend(DEVICE, GpuConfig(attention="triton", compile_elementwise=False), processors=2)


@pytest.mark.parametrize("kv_format,dtype,window", [("plain", F32, None), ("plain", F16, 7), ("fp8", F16, None)],
                         ids=str)
def test_a_mixed_step_through_the_backend_matches_the_gather_path(kv_format, dtype, window):
    """paged_attention with the CUDA backend's hooks (KV writes, decode, every prefill segment) against the same
    step on copies of the pages without them: decode rows, a fresh prompt, a chunk after a prefix. With fp8
    pages the fresh prompt attends to its own unquantised keys, the chunk to its quantised pages."""
    gen = torch.Generator().manual_seed(7)
    make = pages if kv_format == "plain" else fp8_pages
    decode_lens, segs = [5, 12, 17], [(0, 6), (8, 5)]
    tables = random_tables(decode_lens + [c + n for c, n in segs], gen)
    rows = len(decode_lens) + sum(n for _, n in segs)
    q, k, v = (torch.randn(rows, h, HEAD_DIM, generator=gen).to(dtype).to(DEVICE) for h in (4, 2, 2))
    ours, theirs = make(2, dtype, torch.Generator().manual_seed(8)), make(2, dtype, torch.Generator().manual_seed(8))

    def step(caches, with_backend):
        meta = AttentionMetadata.build(BLOCK, list(zip(tables, decode_lens)),
                                       [(t, c, n) for t, (c, n) in zip(tables[3:], segs)],
                                       use_kernels=with_backend, device=DEVICE)
        return paged_attention(q, k, v, *caches, meta, 0.3, backend() if with_backend else None, window)

    close(step(ours, True), step(theirs, False), dtype)
    if kv_format == "plain":  # the kernel wrote the same pages index_copy_ did
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
