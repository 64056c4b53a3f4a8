"""Test tiers: every test is exactly one of `unit`, `engine` or `process`.

- unit: pure Python and numba/torch on small arrays; no model runs (block pool, codec, sampler, config, ...).
- engine: in-process model runs on the tiny random models (and the C++ kernels).
- process: subprocesses (actors, servers, `python -c`), real sockets, the real SmolLM2 model (`slow`).

A module's tier comes from MODULE_TIERS; a test in a module that mixes tiers carries its own marker
(`@pytest.mark.process`, ...), which wins over the module's. `slow` (the real model) counts as `process`.
conftest.py applies this at collection and refuses to run a test that has no tier or two.
`make test-fast` runs `-m "unit or engine"`. The table may name modules that other branches add before they
are merged; an entry for a module that does not exist has no effect.
"""
from __future__ import annotations

import re
from enum import Enum
from typing import Callable, Iterable, Mapping


class Tier(str, Enum):
    UNIT = "unit"
    ENGINE = "engine"
    PROCESS = "process"


U, E, P = Tier.UNIT, Tier.ENGINE, Tier.PROCESS

MODULE_TIERS: Mapping[str, Tier] = {
    "test_actor_stats.py": P,
    "test_actors.py": P,
    "test_api_routes.py": P,
    "test_anthropic_messages.py": U,
    "test_api_smollm2.py": P,  # slow: the real model
    "test_async_llm.py": E,
    "test_attention.py": E,
    "test_auto_vs_bf16.py": U,  # its OpenMP wait-policy option
    "test_block_pool.py": U,  # one test hashes in subprocesses: marked process
    "test_bench_kv_tiers.py": U,
    "test_calibration.py": E,
    "test_calibration_store.py": E,  # the actors' calibration path, in this process
    "test_checkpoint_identity.py": U,
    "test_class_size.py": U,
    "test_chat_session.py": U,  # the command driven through its stdin is marked process
    "test_cli_config.py": P,  # the config-file parsing tests are marked unit, the shells run as subprocesses
    "test_cli_flags.py": P,  # most of its tests read `cli.py --help` from a subprocess
    "test_cpu_kernels.py": E,
    "test_cuda.py": E,  # one test starts actors on the GPU: marked process
    "test_cuda_graphs.py": E,  # graph bookkeeping; the runner on a tiny model with interpreted Triton kernels
    "test_decode_stack.py": E,
    "test_dispatch.py": E,  # the kernel dispatch table: its pure parts unit-sized, its kernels and builder in-process
    "test_default_model.py": P,
    "test_disagg_inprocess.py": E,
    "test_disk_cache.py": U,  # the two-writer test runs in subprocesses: marked process
    "test_draft_actor.py": P,  # the layout and flag tests are marked unit
    "test_elastic.py": P,  # role changes and degrading on real actor processes
    "test_elastic_bench.py": U,
    "test_merges.py": U,  # the router's side of merging cores, against fake actors
    "test_embeddings_api.py": P,  # slow: the default model; the parser's fuzz is marked unit
    "test_engine.py": E,
    "test_engine_client.py": U,
    "test_engine_thread.py": U,
    "test_footprint.py": U,  # the embedded engine's refusal is marked engine
    "test_gemma.py": E,
    "test_gguf_loader.py": U,  # the default model's tests are slow
    "test_gguf_quants.py": U,
    "test_gguf_exact.py": E,  # the C++ kernels and tiny models
    "test_gguf_repack.py": E,  # the C++ kernels and tiny models
    "test_gguf_sentencepiece.py": U,  # the chat tests run the engine: marked engine
    "test_gpu_backend.py": U,  # the GPU backend's selection with the device faked
    "test_gpu_check.py": P,  # bench/gpu_check.py's dry run in a subprocess
    "test_handoff.py": U,
    "test_host_memory.py": U,  # the allocator test runs in subprocesses: marked process
    "test_int4_gemm.py": E,  # the AVX-512 int4 GEMM against the weight-only kernel, in-process
    "test_bf16_dots.py": E,  # the int4 and int8g products on bf16 dot products against float64, in-process
    "test_json_grammar.py": E,
    "test_kernel_accuracy.py": P,  # slow: the real models
    "test_kernel_accuracy_rules.py": E,  # the gate's rules; one test builds a kernel backend
    "test_kernel_build.py": E,  # build keys and errors; one test runs a failing compiler
    "test_kv_cache_quant.py": E,  # one test starts actors: marked process
    "test_kv_compress.py": E,
    "test_kv_staging.py": E,
    "test_kv_stream.py": P,  # real sockets and threads; one test runs a decode worker
    "test_kv_tier_store.py": U,  # the tests with writers in subprocesses are marked process
    "test_kv_tiers.py": E,
    "test_kv_tiers_actors.py": P,  # decode actors sharing a host tier; a server restarted on its disk tier
    "test_kv_quant.py": U,  # the import and CUDA-simulator checks run in subprocesses: marked process
    "test_layers.py": U,
    "test_leaks.py": U,  # the child-watching test is marked process
    "test_lm_head.py": E,
    "test_logs.py": P,  # the logging, calibration and kernel-key units are marked unit
    "test_metrics.py": P,  # the ServerMetrics and PromQL tests are marked unit
    "test_messages_api.py": P,  # slow: the real model
    "test_migration.py": P,
    "test_model_errors.py": P,  # the resolve and check tests in this process are marked unit
    "test_model_parity.py": E,
    "test_olmo2.py": E,
    "test_packaging.py": P,  # runs setuptools' editable build in a subprocess
    "test_placement.py": U,
    "test_planner.py": U,  # the elastic planner on synthetic traffic and a fake clock
    "test_report.py": U,  # synthetic bench results through bench/report.py, plots drawn with Agg
    "test_request_fields.py": U,
    "test_prefill_rate_bench.py": E,
    "test_prefill_shares.py": U,
    "test_itl_target.py": U,
    "test_layered_prefill.py": E,
    "test_prompt_attention.py": E,
    "test_prompt_pass.py": E,  # the wire round trip is marked unit
    "test_ray.py": P,  # a Ray cluster on loopback and actors on it
    "test_ray_degrade.py": P,  # a three-node Ray cluster on loopback that loses its decode node
    "test_ray_options.py": U,  # the no-Ray-import check runs in a subprocess: marked process
    "test_readme.py": P,  # slow: the default model, a real server and fresh interpreters
    "test_real_shapes.py": E,  # the quantiser, type-rule and CLI tests are marked unit
    "test_qwen3.py": E,
    "test_reasoning.py": U,  # the grammar and LLM.chat tests are marked engine
    "test_reasoning_api.py": P,
    "test_reasoning_routes.py": P,
    "test_real_gemma3.py": P,  # slow: a real Gemma 3 GGUF from a registry package
    "test_responses_api.py": P,  # a server on the tiny model: the route's errors, store, disconnects and streams
    "test_responses_smollm2.py": P,  # slow: the real model through the official client
    "test_responses_units.py": U,
    "test_resume.py": E,
    "test_sampler.py": U,
    "test_sampling_controls.py": U,
    "test_sampling_controls_api.py": P,
    "test_scheduler_updates.py": U,
    "test_structured_outputs.py": E,
    "test_structured_outputs_api.py": P,
    "test_sampling_controls_engine.py": E,
    "test_sampling_params.py": U,
    "test_server.py": P,  # request parsing is marked unit, the drain and error tests engine
    "test_server_actors.py": P,
    "test_server_lifecycle.py": P,
    "test_shared_pool.py": U,
    "test_sliding_window.py": E,
    "test_source_hygiene.py": U,
    "test_start_watch.py": U,  # the supervisor with a silent actor process is marked process
    "test_startup.py": U,  # the process-age test starts an interpreter: marked process
    "test_spec_decode.py": E,
    "test_spec_decode_units.py": U,
    "test_stats_record.py": U,
    "test_step_types.py": U,
    "test_stop_checker.py": U,
    "test_stream_delivery.py": P,
    "test_stream_pacing.py": U,
    "test_tiers.py": U,
    "test_thinking_budget.py": U,  # the engine runs are marked engine
    "test_tiled_linear.py": E,
    "test_tokenizer.py": U,  # SmolLM2's tokenizer tests are slow
    "test_tool_calls.py": U,  # the grammar and LLM.chat tests are marked engine
    "test_tool_calls_api.py": P,
    "test_transport.py": U,  # the tests over real sockets are marked process
    "test_triton_attention.py": E,  # the Triton kernels, interpreted on the CPU
    "test_treatment.py": E,
    "test_weight_int8.py": E,
    "test_weight_cache.py": E,  # the two-process fill is marked process
    "test_real_size.py": P,  # the bench's starts run in subprocesses
    "test_weight_int4.py": E,
    "test_window_kv.py": E,
    "test_workloads.py": U,
}
IMPLIES = {"slow": P}  # other markers that fix a test's tier
TIER_NAMES = frozenset(t.value for t in Tier)


class TierError(ValueError):
    """A test with no tier, or with two."""


def tier_of(module: str, markers: Iterable[str], table: Mapping[str, Tier] = MODULE_TIERS) -> Tier:
    """The tier of one test, from its module's file name and the names of its own markers."""
    names = set(markers)
    explicit = {Tier(n) for n in names & TIER_NAMES} | {IMPLIES[n] for n in names & IMPLIES.keys()}
    if len(explicit) > 1:
        raise TierError(f"two tiers: {sorted(t.value for t in explicit)}")
    if explicit:
        return explicit.pop()
    if module not in table:
        raise TierError(f"{module} has no tier: add it to MODULE_TIERS in tests/tiers.py")
    return table[module]


_TIER_MARKER = re.compile(r"\bmark\.(\w+)\b")


def tier_selector(markexpr: str) -> Callable[[Tier], bool] | None:
    """What a `-m` expression made of tier names alone (`unit or engine`) says of a test of each tier; None for any
    other expression (one naming `slow` or another marker), which only the collected tests can answer."""
    names = set(re.findall(r"\w+", markexpr)) - {"and", "or", "not"}
    if not re.fullmatch(r"[\w\s()]+", markexpr) or not names or not names <= TIER_NAMES:
        return None
    try:
        code = compile(markexpr, "<-m>", "eval")
    except SyntaxError:  # pytest's own parser names the error
        return None
    return lambda tier: bool(eval(code, {"__builtins__": {}}, {t.value: t is tier for t in Tier}))


def module_tiers(module: str, source: str, table: Mapping[str, Tier] = MODULE_TIERS) -> set[Tier] | None:
    """The tiers a test module's tests may have, read from its source without importing it: its own tier and each
    tier marker (or marker implying one) the source names. None for a module MODULE_TIERS does not list."""
    if module not in table:
        return None
    named = set(_TIER_MARKER.findall(source))
    return ({table[module]} | {Tier(n) for n in named & TIER_NAMES}
            | {IMPLIES[n] for n in named & IMPLIES.keys()})
