"""What will be resident, said before anything loads: the estimate from a checkpoint's shapes and GGUF types, the
one-sentence refusal when it does not fit (with injected "available" figures), the actors of a layout that hold
copies, and the embedded engine refusing before its weights load."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from actors.spec import ActorSpec
from engine.config import ConfigError, EngineConfig, ModelConfig
from engine.kv.cache import bytes_per_block
from engine.model.footprint import (PROCESS_BYTES, Footprint, InsufficientMemoryError, activation_footprint,
                                    engine_footprint, kv_footprint, tensor_bytes, weight_footprint)
from engine.model.loader import ModelSource
from engine.model.quant import WeightChoice
from router.layout import local_footprint

GiB = 1 << 30
CFG = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, max_position_embeddings=4096, tie_word_embeddings=True)


def _shapes(cfg: ModelConfig = CFG, head: bool = False) -> dict[str, tuple[int, ...]]:
    """A Llama checkpoint's names and shapes; `head`: an lm_head.weight of its own."""
    h, q, kv, ffn = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
                   p + "mlp.down_proj.weight": (h, ffn), p + "input_layernorm.weight": (h,),
                   p + "post_attention_layernorm.weight": (h,)}
    return shapes | ({"lm_head.weight": (cfg.vocab_size, h)} if head else {})


def _source(cfg: ModelConfig = CFG, types: dict[str, str] | None = None) -> ModelSource:
    def no_weights():
        raise AssertionError("an estimate reads no weights")

    return ModelSource(Path("fake"), "fake", cfg, None, no_weights, lambda: _shapes(cfg), types or {})


def _projection_elements(cfg: ModelConfig = CFG) -> int:
    h, q, kv, ffn = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    return cfg.num_layers * (2 * q * h + 2 * kv * h + 3 * ffn * h)


def _other_elements(cfg: ModelConfig = CFG) -> int:
    """Embedding table and norms."""
    return cfg.vocab_size * cfg.hidden_size + (2 * cfg.num_layers + 1) * cfg.hidden_size


# ---------------------------------------------------------------- the weights


def test_each_format_costs_what_the_kernels_read():
    assert tensor_bytes((256, 64), "bfloat16", torch.bfloat16) == 256 * 64 * 2
    assert tensor_bytes((256, 64), "bfloat16", torch.float32) == 256 * 64 * 4  # plain: the serving dtype
    assert tensor_bytes((256, 64), "int8", torch.bfloat16) == 256 * 64 + 256 * 4  # codes + an fp32 scale per row
    # int4: half a byte per weight, and an fp16 scale and offset per 32 along K
    assert tensor_bytes((256, 64), "int4", torch.bfloat16) == 256 * 64 // 2 + 2 * 2 * 256 * 64 // 32
    assert tensor_bytes((64,), "int4", torch.bfloat16) == 64 * 2  # a vector is never quantised


def test_bf16_weights_are_two_bytes_each_and_a_tied_head_counts_once():
    plain = weight_footprint(_shapes(), WeightChoice("bfloat16", "bfloat16"), torch.bfloat16, tied=True)
    assert plain.weights == 2 * (_projection_elements() + _other_elements())
    assert (plain.weight_format, plain.copies) == ("bfloat16", 1)
    with_head = weight_footprint(_shapes(head=True), WeightChoice("bfloat16", "bfloat16"), torch.bfloat16, tied=True)
    assert with_head.weights == plain.weights  # a tied model never loads lm_head.weight


def test_quantised_layers_and_an_untied_head_keep_their_own_formats():
    choice = WeightChoice("int4", "int8")
    shapes = _shapes(head=True)
    got = weight_footprint(shapes, choice, torch.bfloat16, tied=False)
    layers = sum(tensor_bytes(s, "int4", torch.bfloat16) for n, s in shapes.items() if "_proj" in n)
    head = CFG.vocab_size * CFG.hidden_size + CFG.vocab_size * 4
    assert got.weights == layers + head + 2 * _other_elements()  # the embedding table stays bf16 when untied
    assert got.weight_format == "int4, LM head int8"


def test_auto_reads_the_gguf_types_from_the_header():
    q4 = {name: "Q4_0" for name in _shapes() if "_proj" in name} | {"model.embed_tokens.weight": "Q8_0"}
    auto = engine_footprint(_source(types=q4), EngineConfig(num_kv_blocks=1), torch.bfloat16, 64 * GiB)
    forced = engine_footprint(_source(types=q4), EngineConfig(num_kv_blocks=1, weight_dtype="int4"), torch.bfloat16,
                              64 * GiB)
    assert auto.weight_format == "int4, LM head int8g"  # a Q8_0 head: int8g holds it exactly, int4 does not
    assert forced.weight_format == "int4" and forced.weights < auto.weights


# ---------------------------------------------------------------- KV pool, activations, the sum


def test_the_kv_pool_is_sized_as_the_builder_sizes_it():
    block = bytes_per_block(CFG, 16, torch.bfloat16)
    assert kv_footprint(CFG, EngineConfig(num_kv_blocks=10), torch.bfloat16, GiB).kv == 10 * block
    assert kv_footprint(CFG, EngineConfig(kv_cache_memory=10 * block + 1), torch.bfloat16, GiB).kv == 10 * block
    default = kv_footprint(CFG, EngineConfig(), torch.bfloat16, 10 * GiB).kv  # a share of what is free, capped
    assert 0 < default <= GiB
    with pytest.raises(ConfigError, match="--kv-cache-memory"):
        kv_footprint(CFG, EngineConfig(kv_cache_memory=block - 1), torch.bfloat16, GiB)


def test_activations_grow_with_the_step_budget_above_the_process_allowance():
    small = activation_footprint(CFG, EngineConfig(max_num_batched_tokens=64)).activations
    large = activation_footprint(CFG, EngineConfig(max_num_batched_tokens=4096)).activations
    assert PROCESS_BYTES < small < large


def test_an_engine_is_its_weights_pool_and_activations():
    config = EngineConfig(num_kv_blocks=100, weight_dtype="int8")
    engine = engine_footprint(_source(), config, torch.bfloat16, GiB)
    weights = weight_footprint(_shapes(), WeightChoice("int8", "int8"), torch.bfloat16, tied=True)
    assert engine.total == weights.weights + engine.packed + 100 * bytes_per_block(CFG, 16, torch.bfloat16) \
        + activation_footprint(CFG, config).activations
    assert engine_footprint(_source(), config, torch.bfloat16, GiB, kv_pool=False).kv == 0


def test_the_kernels_packed_copies_are_counted_for_bf16_and_int8_not_int4():
    head = CFG.vocab_size * CFG.hidden_size
    per_format = {}
    for fmt in ("bfloat16", "int8", "int4"):
        config = EngineConfig(num_kv_blocks=1, weight_dtype=fmt)
        per_format[fmt] = engine_footprint(_source(), config, torch.bfloat16, GiB).packed
    assert per_format["bfloat16"] == 2 * (_projection_elements() + head)  # the tied head packs the embedding
    matrices = [s for n, s in _shapes().items() if "_proj" in n] + [(CFG.vocab_size, CFG.hidden_size)]
    assert per_format["int8"] == sum(tensor_bytes(s, "int8", torch.bfloat16) for s in matrices)
    assert per_format["int4"] == 0  # read in its own layout
    eager = EngineConfig(num_kv_blocks=1, weight_dtype="bfloat16", enforce_eager=True)
    assert engine_footprint(_source(), eager, torch.bfloat16, GiB).packed == 0  # plain torch ops pack nothing
    described = engine_footprint(_source(), EngineConfig(num_kv_blocks=1), torch.bfloat16, GiB).describe()
    assert " + packed copies " in described


# ---------------------------------------------------------------- the refusal


def test_what_fits_passes_and_what_does_not_is_refused_with_the_numbers():
    footprint = Footprint(weights=int(1.2 * GiB), weight_format="int4", copies=1, kv=40 * GiB,
                          activations=GiB // 2)
    footprint.check(footprint.total)  # exactly enough is enough
    with pytest.raises(InsufficientMemoryError) as info:
        footprint.check(int(18.3 * GiB))
    message = str(info.value)
    assert message == ("model weights 1.2 GiB (int4) + KV pool 40.0 GiB + activations 512.0 MiB = 41.7 GiB, but only "
                       "18.3 GiB is available; lower --kv-cache-memory (or --num-kv-blocks), or free some memory")
    assert isinstance(info.value, ConfigError)  # serve and the CLI report it as one sentence, exit status 2


def test_the_refusal_names_only_the_changes_that_would_matter():
    heavy = Footprint(weights=20 * GiB, weight_format="bfloat16", copies=2, kv=GiB // 4, activations=GiB // 4)
    with pytest.raises(InsufficientMemoryError) as info:
        heavy.check(8 * GiB)
    message = str(info.value)
    assert message.startswith("model weights 2 x 10.0 GiB (bfloat16) + ")
    assert "--weight-dtype int8 or int4" in message and "run fewer actors" in message
    assert "--kv-cache-memory" not in message  # a pool of a fraction of the total is not what to change


def test_local_actors_each_hold_a_copy_and_only_decode_actors_a_pool():
    engine = {"num_kv_blocks": 100, "dtype": "bfloat16"}
    specs = [ActorSpec("prefill-0", "prefill", engine=engine), ActorSpec("decode-0", "decode", engine=engine),
             ActorSpec("decode-1", "decode", engine=engine),
             ActorSpec("decode-2", "decode", engine=engine, remote=True),
             ActorSpec("decode-3", "decode", "cuda:0", engine=engine)]
    footprint, count = local_footprint(specs, _source(), GiB)
    one = engine_footprint(_source(), EngineConfig(**engine), torch.bfloat16, GiB)
    assert count == 3 and footprint.copies == 3  # the remote and the GPU actors hold theirs elsewhere
    assert footprint.weights == 3 * one.weights and footprint.kv == 2 * one.kv
    assert footprint.describe().startswith("model weights 3 x ")


@pytest.mark.engine
def test_the_embedded_engine_refuses_before_its_weights_load(tiny_model_dir, monkeypatch, caplog):
    from engine import LLM

    def load_model(*args, **kwargs):
        raise AssertionError("the weights began to load")

    monkeypatch.setattr("engine.core.builder.load_model", load_model)
    caplog.set_level(logging.INFO, logger="engine.core.builder")
    with pytest.raises(InsufficientMemoryError, match=r"KV pool 100000\.0 GiB .* is available; lower --kv-cache"):
        LLM(str(tiny_model_dir), kv_cache_memory=100_000 * GiB)
    assert any(r.getMessage().startswith("resident once loaded: model weights") for r in caplog.records)
