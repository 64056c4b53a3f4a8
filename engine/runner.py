"""The model runner: turns a SchedulerOutput into one forward pass and one sampling call."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata
from engine.kv_cache import KVCache
from engine.model.llama import LlamaModel
from engine.sampler import SamplingBatch, sample
from engine.scheduler import RunnerOutput, ScheduledChunk, SchedulerOutput


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [B] rows of the flat batch whose logits are sampled
    sampled_chunks: list[ScheduledChunk]


def prepare_input(chunks: list[ScheduledChunk], block_size: int, device: torch.device | str) -> ModelInput:
    """Flatten the chunks: single-token chunks first (the decode group), then each prefill chunk."""
    decodes = [c for c in chunks if len(c.token_ids) == 1]
    prefills = [c for c in chunks if len(c.token_ids) > 1]
    ordered = decodes + prefills
    ids: list[int] = []
    positions: list[int] = []
    sample_rows: list[int] = []
    for chunk in ordered:
        ids.extend(chunk.token_ids)
        positions.extend(range(chunk.start_pos, chunk.start_pos + len(chunk.token_ids)))
        if chunk.sample:
            sample_rows.append(len(ids) - 1)
    meta = AttentionMetadata.build(
        block_size,
        [(c.block_table, c.start_pos + 1) for c in decodes],
        [(c.block_table, c.start_pos, len(c.token_ids)) for c in prefills],
    )
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    return ModelInput(as_tensor(ids), as_tensor(positions), meta, as_tensor(sample_rows),
                      [c for c in ordered if c.sample])


class ModelRunner:
    """Owns the model, its KV pages and the per-sequence sampler generators."""

    def __init__(self, model: LlamaModel, kv_cache: KVCache | None, device: torch.device | str = "cpu") -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.generators: dict[int, torch.Generator] = {}

    @torch.inference_mode()
    def run(self, sched: SchedulerOutput, kv_cache: KVCache | None = None) -> RunnerOutput:
        """One forward over the scheduled chunks; `kv_cache` overrides the runner's own pages (a prefill actor
        computes straight into a decode actor's exported pool)."""
        kv_cache = kv_cache or self.kv_cache
        for seq_id in sched.finished_seq_ids:
            self.generators.pop(seq_id, None)
        if sched.is_empty:
            return RunnerOutput(sampled_token_ids={})
        inp = prepare_input(sched.chunks, kv_cache.block_size, self.device)
        hidden = self.model(inp.input_ids, inp.positions, inp.meta, kv_cache.layers)  # [T, hidden]
        if not inp.sampled_chunks:
            return RunnerOutput(sampled_token_ids={})
        logits = self.model.compute_logits(hidden[inp.sample_rows])  # [B, V]
        return self._sample(logits, inp.sampled_chunks)

    def _sample(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> RunnerOutput:
        batch = SamplingBatch.build([c.params for c in chunks], [self._generator(c) for c in chunks],
                                    [c.banned_token_ids for c in chunks], self.device)
        out = sample(logits, batch)
        ids = [c.seq_id for c in chunks]
        logprobs = {} if out.logprobs is None else {i: lp for i, lp in zip(ids, out.logprobs) if lp is not None}
        return RunnerOutput(sampled_token_ids=dict(zip(ids, out.token_ids)), logprobs=logprobs)

    def _generator(self, chunk: ScheduledChunk) -> torch.Generator | None:
        if chunk.seed is None or chunk.params.greedy:
            return None
        gen = self.generators.get(chunk.seq_id)
        if gen is None:
            gen = self.generators[chunk.seq_id] = torch.Generator(device=self.device).manual_seed(chunk.seed)
        return gen

    def export_generator(self, seq_id: int) -> bytes | None:
        """The sampler RNG state of a sequence handed to another actor, so seeded sampling continues exactly."""
        gen = self.generators.pop(seq_id, None)
        return None if gen is None else bytes(gen.get_state().numpy())

    def import_generator(self, seq_id: int, state: bytes) -> None:
        gen = torch.Generator(device=self.device)
        gen.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        self.generators[seq_id] = gen
