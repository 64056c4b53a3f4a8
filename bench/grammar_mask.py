"""The per-token cost of a grammar mask on CPU, for the grammar engines this server could use: xgrammar,
llguidance and outlines-core, on the default model's vocabulary (SmolLM2, 49152 tokens).

    python -m bench.grammar_mask [--rounds 5] [--engines xgrammar,llguidance,outlines_core]

For one JSON schema (an object with a string, an integer, an enum, an array of numbers and a nested object),
each engine compiles the grammar once (timed separately), then walks the tokens of a fixed valid document:
at every position it computes the allowed-token mask (a bitmask over the vocabulary, or for outlines-core the
allowed id list written into one) and accepts the next token. Prints, per engine, the compile time and the
median and 90th percentile microseconds of one mask, over all positions of all rounds, plus the accept cost.
Engines that are not installed are skipped.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from engine.model.loader import resolve_model
from engine.sampling.json_grammar import json_schema_ebnf
from engine.sampling.structured import token_bytes

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "user", "guest"]},
        "scores": {"type": "array", "items": {"type": "number"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "role", "scores", "address"],
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "role": "admin", "scores": [9.5, 7.25, 10],
            "address": {"city": "London", "zip": "W1 2AB"}}


class Walk:
    """One engine's matcher for SCHEMA: `mask()` computes the next mask, `accept(token)` advances."""

    mask: Callable[[], None]
    accept: Callable[[int], None]


def xgrammar_walk(tokenizer, vocab: int, eos: list[int]) -> tuple[Callable[[], Walk], float]:
    import xgrammar as xgr

    encoded, _ = token_bytes(tokenizer)
    info = xgr.TokenizerInfo(encoded, xgr.VocabType.RAW, vocab_size=vocab, stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    t = time.perf_counter()
    compiled = compiler.compile_grammar(json_schema_ebnf(SCHEMA))  # the grammar the server compiles
    compile_s = time.perf_counter() - t
    bitmask = xgr.allocate_token_bitmask(1, vocab)

    def start() -> Walk:
        m = xgr.GrammarMatcher(compiled)
        w = Walk()
        w.mask = lambda: m.fill_next_token_bitmask(bitmask, 0)
        w.accept = lambda token: _check(m.accept_token(token), token)
        return w
    return start, compile_s


def llguidance_walk(tokenizer, vocab: int, eos: list[int]) -> tuple[Callable[[], Walk], float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    lltok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab, eos_token=eos[0])
    t = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    first = llguidance.LLMatcher(lltok, grammar)
    _check(not first.is_error(), first.get_error())
    compile_s = time.perf_counter() - t
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)

    def start() -> Walk:
        m = llguidance.LLMatcher(lltok, grammar)
        w = Walk()
        w.mask = lambda: llguidance.torch.fill_next_token_bitmask(m, bitmask, 0)
        w.accept = lambda token: _check(m.consume_token(token), token)
        return w
    return start, compile_s


def outlines_core_walk(tokenizer, vocab: int, eos: list[int]) -> tuple[Callable[[], Walk], float]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    encoded, special = token_bytes(tokenizer)
    by_bytes: dict[bytes, list[int]] = {}
    for i, b in enumerate(encoded):
        if b and i not in special and i not in eos:
            by_bytes.setdefault(b, []).append(i)
    vocabulary = Vocabulary(eos[0], by_bytes)
    t = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA), r"[ ]?"), vocabulary)
    compile_s = time.perf_counter() - t
    mask = torch.zeros((vocab + 31) // 32, dtype=torch.int32)

    def start() -> Walk:
        g = Guide(index)
        w = Walk()
        w.mask = lambda: g.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
        w.accept = lambda token: g.advance(token)
        return w
    return start, compile_s


ENGINES = {"xgrammar": xgrammar_walk, "llguidance": llguidance_walk, "outlines_core": outlines_core_walk}


def _check(ok, what) -> None:
    if not ok:
        raise RuntimeError(f"rejected: {what}")


def measure(start: Callable[[], Walk], tokens: list[int], rounds: int) -> tuple[list[float], list[float]]:
    masks, accepts = [], []
    for _ in range(rounds):
        w = start()
        for token in tokens:
            t0 = time.perf_counter()
            w.mask()
            t1 = time.perf_counter()
            w.accept(token)
            t2 = time.perf_counter()
            masks.append(t1 - t0)
            accepts.append(t2 - t1)
    return masks, accepts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--engines", default=",".join(ENGINES))
    args = ap.parse_args(argv)
    source = resolve_model(None)
    tokenizer, vocab = source.tokenizer, source.config.vocab_size
    eos = list(tokenizer.eos_token_ids)
    tokens = tokenizer.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    print(f"vocab {vocab}, document of {len(tokens)} tokens, {args.rounds} rounds, torch threads "
          f"{torch.get_num_threads()}")
    print(f"{'engine':<14} {'compile ms':>10} {'mask p50 us':>12} {'mask p90 us':>12} {'accept p50 us':>14}")
    for name in args.engines.split(","):
        try:
            start, compile_s = ENGINES[name](tokenizer, vocab, eos)
            masks, accepts = measure(start, tokens, args.rounds)
        except ImportError as e:
            print(f"{name:<14} not installed ({e.name})")
            continue
        except Exception as e:  # a failing engine is reported, the others still run
            print(f"{name:<14} failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        p90 = statistics.quantiles(masks, n=10)[-1]
        print(f"{name:<14} {compile_s * 1e3:>10.1f} {statistics.median(masks) * 1e6:>12.1f} {p90 * 1e6:>12.1f} "
              f"{statistics.median(accepts) * 1e6:>14.1f}")


if __name__ == "__main__":
    main()
