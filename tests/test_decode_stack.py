"""The C++ decode stack (engine/kernels/decode_stack.cpp): bit-identical to the Python layer loop it replaces, and
taken only for the steps it covers."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine import LLM, SamplingParams
from engine.backends.attention import AttentionMetadata
from engine.backends import CpuKernelBackend, TorchBackend
from engine.backends.dispatch import Route
from engine.kernels import cpu_ext
from engine.kv.cache import KVCache
from engine.model.hf_loader import iter_hf_weights, read_hf_config
from engine.model.llama import LlamaModel, build_model
from tests.kernel_helpers import kernel_backend, kernel_model, reconfigure, require_kernels
from tests.kernel_helpers import stack_calls  # noqa: F401 (fixture)
from tests.tiny_models import write_tiny_model


@pytest.fixture(autouse=True)
def kernels() -> None:
    require_kernels(vectors=True, onednn=True)

BLOCK = 4
PROMPTS = [[5, 9, 33, 2, 7, 100, 3], [11, 12, 13], [400, 401, 402, 403, 404, 405, 406, 407, 408, 409, 410, 411, 412],
           [21], [7, 8, 9, 10, 11]]  # contexts of 1 to 13 tokens: part blocks, whole blocks, several blocks


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    """A tiny Qwen2: biases on the q/k/v projection."""
    from transformers import Qwen2Config

    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=False, rms_norm_eps=1e-6)
    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), config, seed=3)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A tiny Qwen3: per-head q/k norms (weights away from one), head_dim unequal to hidden / heads."""
    from tests.tiny_models import tiny_qwen3_config

    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), tiny_qwen3_config(), seed=3, random_norms=True)


def prefilled(model: LlamaModel) -> tuple[KVCache, list[list[int]]]:
    """Pages holding every prompt (prefilled by the Python layers), and each prompt's block table."""
    kv = KVCache(model.cfg, 40, BLOCK, torch.bfloat16)
    tables = [list(range(8 * i + 7, 8 * i - 1, -1)) for i in range(len(PROMPTS))]  # descending: scattered blocks
    with torch.inference_mode():
        for table, ids in zip(tables, PROMPTS):
            model(torch.tensor(ids), torch.arange(len(ids)), AttentionMetadata.build(BLOCK, [], [(table, 0, len(ids))],
                                                                                     True), kv.layers)
    return kv, tables


def decode_steps(model: LlamaModel, kv: KVCache, tables: list[list[int]], seqs: list[int], stack: bool,
                 num_layers: int | None = None, steps: int = 3) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`steps` decode steps of the sequences `seqs` on a copy of kv -> (logits of each step, the pages after)."""
    pages = KVCache(model.cfg, kv.num_blocks, BLOCK, torch.bfloat16)
    pages.data.copy_(kv.data)
    reconfigure(model, decode_stack=stack)
    logits = []
    with torch.inference_mode():
        for step in range(steps):
            positions = [len(PROMPTS[i]) + step for i in seqs]
            meta = AttentionMetadata.build(BLOCK, [(tables[i], p + 1) for i, p in zip(seqs, positions)], [], True)
            hidden = model(torch.tensor([30 + 7 * step + i for i in seqs]), torch.tensor(positions), meta,
                           pages.layers, num_layers)
            logits.append(model.compute_logits(hidden))
    return logits, pages.data


def assert_stack_matches_layers(model, seqs, stack_calls, num_layers=None):
    kv, tables = prefilled(model)
    layers_logits, layers_pages = decode_steps(model, kv, tables, seqs, stack=False, num_layers=num_layers)
    assert stack_calls == []
    stack_logits, stack_pages = decode_steps(model, kv, tables, seqs, stack=True, num_layers=num_layers)
    assert stack_calls == [len(seqs)] * 3
    for got, ref in zip(stack_logits, layers_logits):
        assert torch.equal(got, ref)
    assert torch.equal(stack_pages, layers_pages)  # the same keys and values written


@pytest.mark.parametrize("seqs", [[0], [2], [0, 1], [4, 2, 0, 3, 1]], ids=["1-seq", "1-seq-long", "2-seqs", "5-seqs"])
def test_stack_is_bit_identical_to_the_python_layers(tiny_model_dir, seqs, stack_calls):
    """Logits and written pages, at 1 row (GEMV products) and several (packed products), unequal contexts."""
    assert_stack_matches_layers(kernel_model(tiny_model_dir), seqs, stack_calls)


@pytest.mark.parametrize("gemv_rows,packed_rows", [(0, 0), (8, 0)], ids=["f-linear", "gemv-several-rows"])
def test_stack_follows_the_product_limits(tiny_model_dir, gemv_rows, packed_rows, stack_calls):
    model = kernel_model(tiny_model_dir, max_gemv_rows=gemv_rows, max_onednn_rows=packed_rows,
                         max_tiled_rows=packed_rows, linear_fp32=False)  # F.linear in bf16, as the stack has it
    assert_stack_matches_layers(model, [0, 1, 2], stack_calls)


def test_steps_the_table_sends_to_linear32_run_the_python_layers(tiny_model_dir, stack_calls):
    """The stack's F.linear is bf16's: at a row count the table sends to linear32 (F.linear in fp32) the step runs
    the layers from Python, at the others the stack, and the logits are the same either way."""
    route = Route.from_points([(1, "gemv"), (3, "linear32")])
    table = dataclasses.replace(CpuKernelBackend().dispatch, bf16=route, measured=("bf16",))
    model = kernel_model(tiny_model_dir, dispatch=table)
    kv, tables = prefilled(model)
    for seqs, stacked in (([0, 1], True), ([0, 1, 2], False), ([4, 2, 0, 3, 1], False)):
        stack_calls.clear()
        layers_logits, _ = decode_steps(model, kv, tables, seqs, stack=False)
        logits, _ = decode_steps(model, kv, tables, seqs, stack=True)
        assert stack_calls == ([len(seqs)] * 3 if stacked else [])
        assert all(torch.equal(a, b) for a, b in zip(logits, layers_logits))
    # a format the layers do not have going to linear32 keeps the stack (these layers are bf16)
    other = dataclasses.replace(CpuKernelBackend().dispatch, int4=Route.only("linear32"), measured=("int4",))
    model = kernel_model(tiny_model_dir, dispatch=other)
    stack_calls.clear()
    decode_steps(model, *prefilled(model), [0, 1, 2], stack=True)
    assert stack_calls == [3] * 3


@pytest.mark.parametrize("points", [[(1, "gemv"), (3, "packed")], [(1, "linear"), (2, "packed"), (3, "gemv"),
                                                                    (5, "linear")]],
                         ids=["gemv-then-packed", "packed-gemv-linear"])
def test_stack_follows_a_dispatch_table(tiny_model_dir, points, stack_calls):
    """Tables no pair of row limits expresses (the GEMV past the packed copy's rows, or before them): the stack
    takes at 1, 2, 3 and 5 rows the kernels the Python layers take."""
    packing = CpuKernelBackend().packing
    route = Route.from_points([(first, packing if kernel == "packed" else kernel) for first, kernel in points])
    table = dataclasses.replace(CpuKernelBackend().dispatch, bf16=route, measured=("bf16",))
    model = kernel_model(tiny_model_dir, dispatch=table)
    for seqs in ([0], [0, 1], [0, 1, 2], [4, 2, 0, 3, 1]):
        stack_calls.clear()
        assert_stack_matches_layers(model, seqs, stack_calls)


def test_stack_with_projection_biases(qwen2_dir, stack_calls):
    model = kernel_model(qwen2_dir)
    assert model.layers[0].self_attn.qkv_proj.bias is not None
    for seqs in ([1], [0, 1, 2]):
        stack_calls.clear()
        assert_stack_matches_layers(model, seqs, stack_calls)


def test_stack_with_per_head_qk_norm(qwen3_dir, stack_calls):
    model = kernel_model(qwen3_dir)
    assert model.layers[0].self_attn.q_norm is not None
    for seqs in ([1], [0, 1, 2]):
        stack_calls.clear()
        assert_stack_matches_layers(model, seqs, stack_calls)


def test_stack_runs_the_first_layers_of_a_self_draft(tiny_model_dir, stack_calls):
    assert_stack_matches_layers(kernel_model(tiny_model_dir), [0, 1], stack_calls, num_layers=1)


def test_verification_rows_take_the_stack(tiny_model_dir, stack_calls):
    """A sequence's last token + drafts as decode rows with growing contexts (the runner's verify_as_rows)."""
    model = kernel_model(tiny_model_dir)
    kv, tables = prefilled(model)
    start = len(PROMPTS[0])
    hidden = {}
    for stack in (False, True):
        pages = KVCache(model.cfg, kv.num_blocks, BLOCK, torch.bfloat16)
        pages.data.copy_(kv.data)
        meta = AttentionMetadata.build(BLOCK, [(tables[0], start + j + 1) for j in range(4)], [], True,
                                       num_decode_seqs=1)
        reconfigure(model, decode_stack=stack)
        hidden[stack] = model(torch.tensor([12, 13, 14, 15]), torch.arange(start, start + 4), meta, pages.layers)
    assert stack_calls == [4] and torch.equal(hidden[True], hidden[False])


def test_stack_is_not_taken_outside_decode_only_bf16_steps(tiny_model_dir, stack_calls):
    model = kernel_model(tiny_model_dir)
    kv, tables = prefilled(model)
    ids, positions = torch.tensor([3, 4, 5]), torch.tensor([len(PROMPTS[0]), 0, 1])
    mixed = AttentionMetadata.build(BLOCK, [(tables[0], len(PROMPTS[0]) + 1)], [(tables[1], 0, 2)], True)
    fp8 = KVCache(model.cfg, kv.num_blocks, BLOCK, torch.bfloat16, kv_format="fp8")

    def decode_meta(kernels: bool = True) -> AttentionMetadata:
        return AttentionMetadata.build(BLOCK, [(tables[0], len(PROMPTS[0]) + 1)], [], kernels)

    with torch.inference_mode():
        model(ids, positions, mixed, kv.layers)  # decode rows and a prefill chunk
        model(ids[:1], positions[:1], decode_meta(), fp8.layers)  # fp8 pages
        model(ids[:1], positions[:1], decode_meta(kernels=False), kv.layers)  # attention by gather + SDPA
        model.set_backend(TorchBackend())
        model(ids[:1], positions[:1], decode_meta(), kv.layers)  # kernels off: plain torch ops
    assert stack_calls == [] and model.prepared.stack is None


def test_engine_decode_steps_take_the_stack_and_generate_the_same_tokens(tiny_model_dir, stack_calls):
    prompts = ["the cat sat on the mat", "hello there world", "one two three four five six seven"]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    tokens = {}
    for stack in (False, True):
        llm = LLM(model=str(tiny_model_dir), dtype="bfloat16", num_kv_blocks=64)
        llm.engine.runner.set_backend(kernel_backend(decode_stack=stack))
        tokens[stack] = [o.token_ids for o in llm.generate(prompts, params)]
        assert bool(stack_calls) == stack
    assert tokens[True] == tokens[False]
    assert max(stack_calls) == len(prompts)  # the three sequences decoded together


@pytest.mark.parametrize("options", [dict(kv_cache_dtype="fp8"), dict(enforce_eager=True)], ids=["fp8", "eager"])
def test_engine_without_plain_bf16_kernels_never_takes_the_stack(tiny_model_dir, options, stack_calls):
    llm = LLM(model=str(tiny_model_dir), dtype="bfloat16", num_kv_blocks=64, **options)
    llm.generate(["the cat sat on the mat"], SamplingParams(max_tokens=6, temperature=0.0))
    assert stack_calls == []


def test_stack_rejects_a_slot_outside_the_pages(tiny_model_dir):
    model = kernel_model(tiny_model_dir)
    kv, tables = prefilled(model)
    meta = AttentionMetadata.build(BLOCK, [(tables[0], len(PROMPTS[0]) + 1)], [], True)
    meta.slot_mapping = torch.tensor([kv.num_blocks * BLOCK])  # one past the last slot
    with torch.inference_mode(), pytest.raises(RuntimeError, match="outside the pages"):
        model(torch.tensor([3]), torch.tensor([len(PROMPTS[0])]), meta, kv.layers)


@pytest.mark.parametrize("points", [[(1, "int8g"), (3, "linear")], [(1, "int8g"), (2, "int8g_bf16"), (4, "linear")]],
                         ids=["int8g", "int8g-bf16-dots"])
def test_stack_runs_int8g_layers(tmp_path, stack_calls, monkeypatch, points):
    """A GGUF file's K-quant blocks held exactly as int8g (auto on a Q4_K_M-style mix, one layer's q|k|v Q4_0 and so
    int4): the stack takes the int8g kernels the route names (the weight-only one, the one on bf16 dot products)
    and the dequantised F.linear past it, as the Python layers do."""
    from engine.model.loader import load_model, resolve_model
    from tests import test_gguf_quants as mixed
    from tests.test_gguf_exact import MIXED

    path = tmp_path / "m.gguf"
    mixed.write_mixed_gguf(path, MIXED)
    model = load_model(resolve_model(path), torch.bfloat16, weight_dtype="auto")
    assert model.weight_dtype == "int8g+int4"
    if any(kernel == "int8g_bf16" for _, kernel in points) and not cpu_ext.int8g_bf16_vectorized():
        pytest.skip("built without AVX-512 BF16")
    table = dataclasses.replace(CpuKernelBackend().dispatch, int8g=Route.from_points(points))
    model.set_backend(kernel_backend(dispatch=table))
    monkeypatch.setitem(globals(), "PROMPTS", [[i % 300 for i in ids] for ids in PROMPTS])  # the GGUF's vocabulary
    for seqs in ([0], [0, 1], [4, 2, 0, 3, 1]):
        stack_calls.clear()
        assert_stack_matches_layers(model, seqs, stack_calls)


def test_stack_runs_int4_layers_on_each_int4_kernel(tiny_model_dir, stack_calls, monkeypatch):
    """int4 weights with a table giving one row to the AVX-512 int4 GEMM, two to the weight-only kernel and three
    or more to the product on bf16 dot products (where built): the stack takes each where the layers do."""
    if not cpu_ext.int4_bf16_vectorized():
        pytest.skip("built without AVX-512 BF16")
    model = build_model(read_hf_config(tiny_model_dir), iter_hf_weights(tiny_model_dir), torch.bfloat16,
                        weight_dtype="int4")
    route = Route.from_points([(1, "int4_gemm"), (2, "int4"), (3, "int4_bf16")])
    model.set_backend(kernel_backend(dispatch=dataclasses.replace(CpuKernelBackend().dispatch, int4=route)))
    rows_seen: list[int] = []  # the Python layers' calls (the stack's stay inside C++)
    kernel = cpu_ext.ops().linear_int4_bf16
    monkeypatch.setattr(cpu_ext.ops(), "linear_int4_bf16",
                        lambda x, *args: rows_seen.append(len(x)) or kernel(x, *args))
    for seqs in ([0], [0, 1], [0, 1, 2], [4, 2, 0, 3, 1]):
        stack_calls.clear()
        assert_stack_matches_layers(model, seqs, stack_calls)
    assert {3, 5} <= set(rows_seen) and not {1, 2} & set(rows_seen)
