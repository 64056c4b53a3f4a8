"""What structured outputs cost a running batch: decode throughput at 32 streams with half of them under a
JSON schema against all of them free, in one process, with the time the grammar masks take per step; and the
compile time of a 20-field schema.

    python -m bench.grammar_cost [--streams 32] [--max-tokens 96] [--rounds 2]

The in-process engine (`from engine import LLM`) on the default model (SmolLM2-135M) runs 32 greedy requests
per round: the free ones with `ignore_eos`, the constrained ones under a schema whose documents are longer
than max_tokens, so that every stream generates the same number of tokens. The two variants take turns
(free, half, free, half, ...) after one warm-up round of each, so a slow minute of a shared host hits both
alike. Per variant it prints output tokens per second (all tokens generated over the
round's wall time), the same per CPU-second of this process (steadier than wall time on a shared host), the
wall time per engine step, and the mask time per step that had constrained rows: `fill`, the seconds in
GuideStates.bitmask (the matchers filling the bitmask rows), and `apply`, in sampler.apply_grammar (the
bitmasks unpacked and applied to the logits), with both as a share of the round's wall time. Each round's own rate is
printed as it finishes.

The compile figures: the first compile of a process (xgrammar's tokenizer tables for the vocabulary, once per
process, plus a small schema), then a fresh 20-field schema (a cache miss), then the same schema again (a
cache hit).
"""
from __future__ import annotations

import argparse
import statistics
import time

import engine.sampling.sampler as sampler
from engine import LLM, SamplingParams
from engine.sampling.structured import Guide, GuideStates, source_compiler

PROMPTS = ["Describe a person as JSON: ", "List three cities and why they matter: ", "Write a short story: ",
           "Give a recipe: "]
# At least 40 hobbies: no document fits in the bench's max_tokens, so a constrained stream runs as long as a free
# one and both variants keep all their rows to the end.
ITEM_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
    "hobbies": {"type": "array", "items": {"type": "string"}, "minItems": 40}},
    "required": ["name", "age", "city", "hobbies"]}
TYPES = ("string", "integer", "number", "boolean")


def twenty_field_schema() -> dict:
    """20 required properties of mixed types, a few with constraints, one nested object and one enum."""
    props: dict[str, dict] = {}
    for i in range(17):
        kind = TYPES[i % len(TYPES)]
        prop: dict = {"type": kind}
        if kind == "string" and i % 8 == 0:
            prop["maxLength"] = 24
        if kind == "integer":
            prop.update(minimum=0, maximum=1000)
        props[f"field_{i:02d}"] = prop
    props["status"] = {"enum": ["open", "closed", "pending"]}
    props["tags"] = {"type": "array", "items": {"type": "string"}, "maxItems": 5}
    props["owner"] = {"type": "object", "properties": {"id": {"type": "integer"}, "email": {"type": "string"}},
                      "required": ["id", "email"]}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


class MaskTimer:
    """Wraps GuideStates.bitmask (the matchers fill the constrained rows' bitmasks; the runner calls it once per
    step that has constrained rows) and sampler.apply_grammar (the bitmasks unpacked and applied to the
    logits)."""

    def __init__(self) -> None:
        self.reset()
        fill, apply = GuideStates.bitmask, sampler.apply_grammar

        def timed_fill(states, items):
            t = time.perf_counter()
            try:
                return fill(states, items)
            finally:
                self.seconds += time.perf_counter() - t
                self.calls += 1

        def timed_apply(*args):
            t = time.perf_counter()
            try:
                return apply(*args)
            finally:
                self.apply_seconds += time.perf_counter() - t
        GuideStates.bitmask = timed_fill
        sampler.apply_grammar = timed_apply

    def reset(self) -> None:
        self.seconds, self.apply_seconds, self.calls = 0.0, 0.0, 0


def round_params(streams: int, constrained: int, max_tokens: int) -> list[SamplingParams]:
    guide = Guide.json_schema(ITEM_SCHEMA)
    return [SamplingParams(max_tokens=max_tokens, temperature=0.0, guide=guide) if i < constrained else
            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True) for i in range(streams)]


def run_round(llm: LLM, streams: int, constrained: int, max_tokens: int, timer: MaskTimer) -> dict:
    prompts = [PROMPTS[i % len(PROMPTS)] + f"(item {i})" for i in range(streams)]
    params = round_params(streams, constrained, max_tokens)
    timer.reset()
    counter = _StepCounter(llm)
    t, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params)
    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
    counter.stop()
    tokens = [len(o.token_ids) for o in outs]
    guided = sum(tokens[:constrained])
    return {"wall": wall, "cpu": cpu, "tokens": sum(tokens), "guided_tokens": guided,
            "free_tokens": sum(tokens) - guided, "steps": counter.steps, "mask_s": timer.seconds,
            "apply_s": timer.apply_seconds, "mask_steps": timer.calls}


class _StepCounter:
    """Counts EngineCore.step calls during one generate()."""

    def __init__(self, llm: LLM) -> None:
        self.steps = 0
        self._engine = llm.engine
        self._inner = llm.engine.step

        def counted():
            self.steps += 1
            return self._inner()
        llm.engine.step = counted

    def stop(self) -> None:
        self._engine.step = self._inner


def compile_times(llm: LLM) -> dict:
    t = time.perf_counter()
    compiler = source_compiler(llm.engine.source)
    compiler.compile(Guide.json_schema({"type": "object", "properties": {"warm": {"type": "string"}}}))
    first = time.perf_counter() - t
    guide = Guide.json_schema(twenty_field_schema())
    t = time.perf_counter()
    compiler.compile(guide)
    miss = time.perf_counter() - t
    t = time.perf_counter()
    compiler.compile(guide)
    hit = time.perf_counter() - t
    return {"first_s": first, "twenty_fields_s": miss, "cache_hit_s": hit}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2, help="measured rounds per variant, after one warm-up each")
    args = ap.parse_args(argv)
    llm = LLM()
    timer = MaskTimer()
    compiled = compile_times(llm)
    print(f"compile: first in process {compiled['first_s'] * 1e3:.0f} ms (tokenizer tables + a 1-field schema); "
          f"20-field schema {compiled['twenty_fields_s'] * 1e3:.1f} ms; again (cache hit) "
          f"{compiled['cache_hit_s'] * 1e6:.0f} us", flush=True)
    variants = {"free": 0, "half": args.streams // 2}
    results: dict[str, list[dict]] = {name: [] for name in variants}
    for r in range(args.rounds + 1):
        for name, constrained in variants.items():
            res = run_round(llm, args.streams, constrained, args.max_tokens, timer)
            print(f"  round {r}{' (warm-up)' if r == 0 else ''} {name}: {res['tokens'] / res['wall']:.1f} tok/s, "
                  f"{res['steps']} steps in {res['wall']:.1f} s", flush=True)
            if r > 0:
                results[name].append(res)
    print(f"{args.streams} streams, max_tokens {args.max_tokens}, greedy, {args.rounds} rounds per variant")
    print(f"{'variant':<8} {'tok/s':>8} {'tok/cpu-s':>10} {'ms/step':>8} {'tokens (guided/free)':>21} "
          f"{'fill ms/step':>13} {'apply ms/step':>14} {'share':>6}")
    rates, per_cpu = {}, {}
    for name, rounds in results.items():
        rates[name] = statistics.median(x["tokens"] / x["wall"] for x in rounds)
        per_cpu[name] = statistics.median(x["tokens"] / x["cpu"] for x in rounds)
        step_ms = 1e3 * statistics.median(x["wall"] / x["steps"] for x in rounds)
        mask_steps = sum(x["mask_steps"] for x in rounds)
        mask_ms = 1e3 * sum(x["mask_s"] for x in rounds) / mask_steps if mask_steps else 0.0
        apply_ms = 1e3 * sum(x["apply_s"] for x in rounds) / mask_steps if mask_steps else 0.0
        share = sum(x["mask_s"] + x["apply_s"] for x in rounds) / sum(x["wall"] for x in rounds)
        last = rounds[-1]
        print(f"{name:<8} {rates[name]:>8.1f} {per_cpu[name]:>10.1f} {step_ms:>8.1f} "
              f"{last['guided_tokens']:>10}/{last['free_tokens']:<10} {mask_ms:>13.2f} {apply_ms:>14.2f} {share:>6.1%}")
    print(f"half constrained vs free: {rates['half'] / rates['free'] - 1:+.1%} tok/s, "
          f"{per_cpu['half'] / per_cpu['free'] - 1:+.1%} tok per CPU-second")


if __name__ == "__main__":
    main()
