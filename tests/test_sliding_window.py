"""Gemma 2, Gemma 3 and Mistral's sliding window against transformers, on tiny random safetensors folders whose
window (8 tokens) is short enough that every test runs well past it.

Logits (fp32, within 1e-4 relative of transformers' forward on the same folder): whole prefill; chunked prefill
whose chunks cross the window's edge; token-by-token decode; a prefill that starts on another sequence's cached
blocks (a prefix-cache hit). Greedy generations through the engine beyond twice the window equal transformers'
generate: colocated (whole and chunked prefill, prefix-cache hits), with speculative decoding (its verification
runs through the same windowed attention) and disaggregated in process (the KV pages handed over as they are).
Quantised pages and the CPU kernels: the blocks that lie wholly outside every window of the step are
overwritten and the logits stay bit for bit the same, so nothing outside the window is read.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.core.builder import build_prefill_engine
from engine import LLM, SamplingParams
from engine.backends.attention import AttentionMetadata
from engine.config import EngineConfig
from engine.kv.cache import KVCache
from engine.model.hf_loader import iter_hf_weights, read_hf_config
from engine.model.llama import build_model
from tests.kernel_helpers import kernel_model, require_kernels
from tests.kernel_helpers import stack_calls  # noqa: F401 (fixture)
from tests.test_disagg_inprocess import run_disaggregated
from tests.test_model_parity import assert_close_relative, decode_logits, paged_logits, reference_logits
from tests.test_spec_decode import repetitive_prompts
from tests.tiny_models import tiny_gemma2_config, tiny_gemma3_config, tiny_mistral_config, write_tiny_model

WINDOW = 8
BLOCK = 4
CONFIGS = {"gemma2": tiny_gemma2_config, "gemma3": tiny_gemma3_config, "mistral": tiny_mistral_config}
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 33, 2, 7], list(range(40, 61)), [11, 12, 13], list(range(100, 113))]


@pytest.fixture(scope="module", params=list(CONFIGS))
def windowed_dir(request, tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp(request.param), CONFIGS[request.param](), seed=1,
                            random_norms=True)


def fp32_model(folder: Path):
    return build_model(read_hf_config(folder), iter_hf_weights(folder), torch.float32)


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_generate(folder: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return [ref.generate(torch.tensor([p]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=0)[0, len(p):].tolist() for p in prompts]


# ---- config ----------------------------------------------------------------------------------------------


def test_configs_name_the_window_and_the_layers_it_applies_to(windowed_dir):
    cfg = read_hf_config(windowed_dir)
    windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]
    expected = {"gemma2": [WINDOW, None] * 2, "gemma3": [WINDOW, WINDOW, None] * 2,
                "llama": [WINDOW] * 2}[cfg.architecture]  # Mistral loads as the llama architecture
    assert windows == expected


# ---- logits against transformers' forward ------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1000, 5, 3, WINDOW], ids=["whole", "chunk-5", "chunk-3", "chunk-window"])
def test_prefill_logits_match_transformers(windowed_dir, chunk):
    """37 tokens: chunks of 5 and 3 straddle the window's edge at every offset."""
    cfg = read_hf_config(windowed_dir)
    ids = random_ids(37, 3)
    assert_close_relative(paged_logits(fp32_model(windowed_dir), cfg, ids, chunk),
                          reference_logits(windowed_dir, ids), 1e-4)


def test_decode_logits_past_the_window_match_transformers(windowed_dir):
    cfg = read_hf_config(windowed_dir)
    ids = random_ids(37, 4)
    assert_close_relative(decode_logits(fp32_model(windowed_dir), cfg, ids),
                          reference_logits(windowed_dir, ids), 1e-4)


@pytest.mark.parametrize("tail_chunk", [1000, 1], ids=["prefill", "decode"])
def test_prefill_after_a_prefix_cache_hit_matches_transformers(windowed_dir, tail_chunk):
    """Sequence A fills 5 blocks (20 tokens, past the window) and more; sequence B shares those blocks in its
    table and computes only its own tail, from position 20: as a prefill chunk, or token by token."""
    cfg = read_hf_config(windowed_dir)
    model = fp32_model(windowed_dir)
    prefix, tail_a, tail_b = random_ids(20, 5), random_ids(9, 6), random_ids(15, 7)
    kv = KVCache(cfg, 24, BLOCK, torch.float32)
    table_a = [3, 1, 7, 0, 9, 2, 4, 5]
    run_chunk(model, kv, table_a, prefix + tail_a, 0)
    table_b = table_a[:5] + [11, 15, 13, 12]
    rows = [run_chunk(model, kv, table_b, tail_b[i:i + tail_chunk], 20 + i)
            for i in range(0, len(tail_b), tail_chunk)]
    expected = reference_logits(windowed_dir, prefix + tail_b)[20:]
    assert_close_relative(torch.cat(rows), expected, 1e-4)


def run_chunk(model, kv: KVCache, table: list[int], ids: list[int], start: int) -> torch.Tensor:
    """Logits of `ids` at positions start.. of the sequence whose blocks are `table` (one token: a decode row)."""
    if len(ids) == 1:
        meta = AttentionMetadata.build(BLOCK, [(table, start + 1)], [])
    else:
        meta = AttentionMetadata.build(BLOCK, [], [(table, start, len(ids))])
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(start, start + len(ids)), meta, kv.layers)
        return model.compute_logits(hidden)


# ---- greedy generations through the engine -----------------------------------------------------------------


@pytest.fixture(scope="module")
def expected_tokens(windowed_dir):
    return hf_generate(windowed_dir, PROMPTS, GREEDY.max_tokens)


@pytest.mark.parametrize("options", [dict(enable_chunked_prefill=False), dict(max_num_batched_tokens=6)],
                         ids=["whole-prefill", "chunked-6"])
def test_engine_greedy_past_twice_the_window_equals_transformers(windowed_dir, expected_tokens, options):
    llm = LLM(str(windowed_dir), dtype="float32", num_kv_blocks=96, block_size=BLOCK, **options)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected_tokens
    llm.engine.pool.check_integrity()


def test_engine_prefix_cache_hits_past_the_window_equal_transformers(windowed_dir):
    """The second request reuses the first one's 16 cached prompt tokens (two windows) and must continue as
    transformers does from its whole prompt."""
    first = random_ids(18, 8)
    second = first[:16] + random_ids(5, 9)
    llm = LLM(str(windowed_dir), dtype="float32", num_kv_blocks=96, block_size=BLOCK)
    outs = [llm.generate([p], GREEDY)[0].token_ids for p in (first, second)]
    assert llm.engine.stats().prefix_hits >= 4  # blocks of the shared prefix
    assert outs == hf_generate(windowed_dir, [first, second], GREEDY.max_tokens)


@pytest.mark.parametrize("options", [dict(speculative="ngram"), dict(speculative="draft", draft_model="self:1")],
                         ids=["ngram", "self-draft"])
def test_speculative_verification_keeps_greedy_outputs(windowed_dir, options):
    """Verification chunks attend through the window like any prefill chunk: greedy tokens equal plain decoding."""
    prompts = repetitive_prompts(4, seed=3)
    plain = LLM(str(windowed_dir), dtype="float32", num_kv_blocks=128, block_size=BLOCK)
    spec = LLM(str(windowed_dir), dtype="float32", num_kv_blocks=128, block_size=BLOCK, num_speculative_tokens=3,
               **options)
    assert [o.token_ids for o in spec.generate(prompts, GREEDY)] == \
        [o.token_ids for o in plain.generate(prompts, GREEDY)]
    assert spec.engine.stats().spec_proposed > 0


@pytest.mark.parametrize("streamed", [False, True], ids=["shared-pool", "streamed-pages"])
def test_disaggregated_greedy_equals_transformers(windowed_dir, expected_tokens, streamed):
    """The prefill engine computes into the decode engine's pool, or (as for another host) into its own, whose
    pages are then written into the reserved blocks. A pool that takes hand-offs keeps every block (decode
    actors build their engines so)."""
    options = dict(dtype="float32", num_kv_blocks=96, block_size=BLOCK, max_num_batched_tokens=6)
    decode = LLM(str(windowed_dir), free_window_kv=False, **options)
    prefill = build_prefill_engine(EngineConfig(model=str(windowed_dir), **options), source=decode.engine.source)
    prefill.attach_pool("decode-0", decode.engine.kv_cache)
    outs, _ = run_disaggregated(decode, prefill, PROMPTS, GREEDY, streamed)
    assert [o.token_ids for o in outs] == expected_tokens
    decode.engine.pool.check_integrity()


# ---- what lies outside the window is never read -------------------------------------------------------------


def outside_blocks(first_query: int, window: int) -> list[int]:
    """Indices (in the table) of the blocks whose every slot precedes the window of the query at first_query."""
    return [b for b in range((first_query - window + 1) // BLOCK)]


def poison(kv: KVCache, cfg, table: list[int], blocks: list[int], donor: int) -> None:
    """Overwrite those blocks' pages in every windowed layer: plain pages with random values, quantised ones
    with another block's (valid) page."""
    ids = torch.tensor([table[b] for b in blocks])
    for layer in range(cfg.num_layers):
        if cfg.layer_window(layer) is None:
            continue
        pages = kv.data[layer]  # [2, N, *page]
        if kv.page_format is None:
            pages[:, ids] = torch.randn(pages[:, ids].shape, generator=torch.Generator().manual_seed(layer)) \
                .to(pages.dtype)
        else:
            pages[:, ids] = pages[:, table[donor]][:, None]


QUANTISED_TOLERANCE = {"fp8": 0.12, "fp4": 0.3}  # these peaked random models measure up to 0.09 and 0.21


@pytest.mark.parametrize("kv_format", ["auto", "fp8", "fp4"])
@pytest.mark.parametrize("step", ["decode", "chunk"])
def test_pages_outside_the_window_are_never_read(windowed_dir, kv_format, step):
    cfg = read_hf_config(windowed_dir)
    model = fp32_model(windowed_dir)
    ids = random_ids(36, 10)
    last = ids[-1:] if step == "decode" else ids[-5:]
    start = len(ids) - len(last)
    logits = []
    for poisoned in (False, True):
        kv = KVCache(cfg, 12, BLOCK, torch.float32, kv_format=kv_format)
        table = list(range(11, 1, -1))
        run_chunk(model, kv, table, ids[:start], 0)
        if poisoned:
            poison(kv, cfg, table, outside_blocks(start, WINDOW), donor=start // BLOCK - 1)
        logits.append(run_chunk(model, kv, table, last, start))
    assert torch.equal(logits[0], logits[1])
    if kv_format != "auto":  # near transformers' still (ignoring the window puts these models 0.5-1.3 away)
        assert_close_relative(logits[0], reference_logits(windowed_dir, ids)[start:], QUANTISED_TOLERANCE[kv_format])


def test_cpu_kernels_decode_past_the_window_within_bf16_rounding(windowed_dir, stack_calls):
    """bf16 on the kernel backend: windowed layers leave the in-place kernels (and the C++ decode stack) once a
    context outgrows the window; the stack runs Mistral's steps until then and no Gemma step (its layers differ
    from Llama's). Logits stay within bf16 rounding of the fp32 reference, and pages outside the window are
    not read."""
    require_kernels(vectors=True)
    model = kernel_model(windowed_dir)
    cfg = model.cfg
    gemma = cfg.sandwich_norms
    assert (model.prepared.stack is None) == gemma
    ids = random_ids(21, 11)
    kv = KVCache(cfg, 8, BLOCK, torch.bfloat16)
    table = list(range(8))
    rows = []
    with torch.inference_mode():
        for pos, tok in enumerate(ids):
            meta = AttentionMetadata.build(BLOCK, [(table, pos + 1)], [], True)
            rows.append(model.compute_logits(model(torch.tensor([tok]), torch.tensor([pos]), meta, kv.layers)))
    assert stack_calls == ([] if gemma else [1] * WINDOW)
    assert_close_relative(torch.cat(rows), reference_logits(windowed_dir, ids), 5e-2)
    prompt = random_ids(17, 12)  # a fresh prompt longer than the window: no prompt kernel on windowed layers
    with torch.inference_mode():
        meta = AttentionMetadata.build(BLOCK, [], [(table, 0, len(prompt))], True)
        hidden = model(torch.tensor(prompt), torch.arange(len(prompt)), meta, kv.layers)
    assert_close_relative(model.compute_logits(hidden), reference_logits(windowed_dir, prompt), 5e-2)
    snapshot = kv.data.clone()
    out = []
    for poisoned in (False, True):
        kv.data.copy_(snapshot)
        if poisoned:
            poison(kv, cfg, table, outside_blocks(len(prompt), WINDOW), donor=3)
        out.append(run_chunk(model, kv, table, [7], len(prompt)))
    assert torch.equal(out[0], out[1])
