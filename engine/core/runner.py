"""The model runner: turns a SchedulerOutput into one forward pass and one sampling call.

Chunks that carry draft tokens (speculative decoding) yield logits at every row; the acceptance rule turns
them into the tokens each such sequence emits this step.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from engine.backends.attention import AttentionMetadata
from engine.backends import Backend, TorchBackend
from engine.core.cuda_graphs import DecodeGraphs, GraphPlan
from engine.kv.host_memory import keep_freed_memory
from engine.kv.cache import KVCache
from engine.model.progress import COMPILING_SAMPLER, Progress, counted
from engine.kv.compress import ColdRegion, names_cold
from engine.model.llama import LayerPass, LlamaModel
from engine.sampling.sampler import (History, SamplingBatch, dense_distribution, dense_warm_ups, greedy_tokens,
                                    process_logits, sample, token_logprobs)
from engine.speculative.acceptance import Verdict, verify_drafts, verify_greedy
from engine.core.prompt_pass import PromptPasses, pass_rows
from engine.core.step import RunnerOutput, ScheduledChunk, SchedulerOutput, position_seed, runner_output
from engine.sampling.structured import GrammarCompiler, GuideStates
from engine.sampling.thinking_budget import forced_rows


@dataclass(frozen=True)
class ModelInput:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata  # KV-cache group 0's
    group_metas: tuple[AttentionMetadata, ...]  # per KV-cache group (engine/kv/groups.py), group 0 first
    sample_rows: torch.Tensor  # [B] rows of the flat batch whose logits are sampled
    sampled_chunks: tuple[ScheduledChunk, ...]
    verify_rows: torch.Tensor  # [R] every row of the chunks with drafts, chunk after chunk
    verified_chunks: tuple[ScheduledChunk, ...]
    prompt_rows: torch.Tensor  # [P] the rows prompt passes read (prompt_pass.pass_rows), chunk after chunk
    prompt_chunks: tuple[ScheduledChunk, ...]  # the chunks those rows belong to


@dataclass
class LayeredChunk:
    """A long prompt's chunk running a few layers a step (SchedulerOutput.layered): its input and how far it got."""

    chunk: ScheduledChunk
    inp: ModelInput
    state: LayerPass
    layers: list  # the KV pages of every layer, which it writes as it goes


def prepare_input(chunks: Sequence[ScheduledChunk], block_size: int, device: torch.device | str,
                  use_kernels: bool = False, verify_as_rows: bool = False) -> ModelInput:
    """Flatten the chunks: single-token chunks first (the decode group), then each multi-token chunk.

    A verification chunk (last token + drafts) is a multi-token segment attending causally to the cached
    context and itself. (Running its tokens as separate decode rows through gather + SDPA gathers the context
    once per row: measured 1.2-3x slower at batch 8 on CPU.) With `verify_as_rows` - for the in-place
    attention kernel, which gathers nothing - verification chunks join the decode group instead, one row per
    token, each attending to the context up to itself.
    """
    in_group = [len(c.token_ids) == 1 or (verify_as_rows and c.num_draft > 0) for c in chunks]
    decodes = [c for c, grouped in zip(chunks, in_group) if grouped]
    prefills = [c for c, grouped in zip(chunks, in_group) if not grouped]
    ordered = decodes + prefills
    ids: list[int] = []
    positions: list[int] = []
    sample_rows: list[int] = []
    verify_rows: list[int] = []
    prompt_rows: list[int] = []
    for chunk in ordered:
        prompt_rows.extend(len(ids) + row for row in pass_rows(chunk))
        ids.extend(chunk.token_ids)
        positions.extend(range(chunk.start_pos, chunk.start_pos + len(chunk.token_ids)))
        if chunk.num_draft:
            verify_rows.extend(range(len(ids) - len(chunk.token_ids), len(ids)))
        elif chunk.sample:
            sample_rows.append(len(ids) - 1)
    num_groups = len(chunks[0].block_tables) if chunks else 1
    metas = tuple(AttentionMetadata.build(
        block_size,
        _decode_rows(decodes, group),
        [(list(c.block_tables[group]), c.start_pos, len(c.token_ids)) for c in prefills],
        use_kernels,
        num_decode_seqs=len(decodes),
        device=device,
    ) for group in range(num_groups))
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    return ModelInput(as_tensor(ids), as_tensor(positions), metas[0], metas, as_tensor(sample_rows),
                      tuple(c for c in ordered if c.sample and not c.num_draft), as_tensor(verify_rows),
                      tuple(c for c in ordered if c.num_draft), as_tensor(prompt_rows),
                      tuple(c for c in ordered if c.prompt_pass))


def _decode_rows(chunks: Sequence[ScheduledChunk], group: int = 0) -> list[tuple[list[int], int]]:
    """(block table of KV-cache group `group`, context length) per token row of the decode group: one row per
    token of each chunk."""
    rows = []
    for c in chunks:
        table = list(c.block_tables[group])  # AttentionMetadata pads the tables as lists
        rows.extend((table, c.start_pos + j + 1) for j in range(len(c.token_ids)))
    return rows


def _plain_greedy(chunks: Sequence[ScheduledChunk]) -> bool:
    """Every row takes its argmax as it is: greedy, no logprobs, no banned tokens, no biases or penalties."""
    return all(c.params.greedy and c.params.logprobs is None and not c.banned_token_ids
               and not c.params.adjusts_logits and not c.params.masks_tokens for c in chunks)


def _budgeted(mask: torch.Tensor, budget: tuple[int, int, int] | None, output: Sequence[int],
              drafts: Sequence[int]) -> torch.Tensor:
    """`mask` [len(drafts) + 1, words] with each row whose position is past the thinking budget allowing the
    closing tag only."""
    if budget is None:
        return mask
    close = budget[2]
    for j, forced in enumerate(forced_rows(budget, output, drafts)):
        if forced:
            mask[j].zero_()
            bit = 1 << (close % 32)
            mask[j, close // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit  # bit 31 is int32's sign
    return mask


def _histories(chunks: Sequence[ScheduledChunk]) -> list[History | None] | None:
    """What each chunk's penalties count at its sampled position; None when no chunk is penalised."""
    if not any(c.params.penalised for c in chunks):
        return None
    return [History(c.history, c.num_prompt_tokens) if c.params.penalised else None for c in chunks]


def _verify_histories(chunks: Sequence[ScheduledChunk]) -> list[History | None] | None:
    """Per verified row (position j of a chunk with drafts): the chunk's history and the j drafts before j,
    so each position is penalised as plain decoding would be had the drafts before it been sampled."""
    if not any(c.params.penalised for c in chunks):
        return None
    return [History(c.history, c.num_prompt_tokens, c.token_ids[1:1 + j]) if c.params.penalised else None
            for c in chunks for j in range(c.num_draft + 1)]


class ModelRunner:
    """Owns the model, its KV pages and the per-sequence sampler generators."""

    def __init__(self, model: LlamaModel, kv_cache: KVCache | None, device: torch.device | str = "cpu",
                 backend: Backend | None = None,
                 grammar_compiler: Callable[[], GrammarCompiler] | None = None, cold: ColdRegion | None = None,
                 graphs: GraphPlan | None = None, progress: Progress | None = None) -> None:
        """`backend`: the hardware operations (engine/backends.select_backend); None = plain torch ops.
        `grammar_compiler`: the engine's (built on first use); None refuses constrained requests.
        `cold`: adaptive compression: old pages of this runner's own pool may live there (engine/kv/compress.py).
        `graphs`: decode steps on this runner's pages to capture now and replay (engine/core/cuda_graphs.py), each
        capture reported to `progress`."""
        self.model = model
        self.kv_cache = kv_cache
        self.device = device
        self.generators: dict[int, torch.Generator] = {}
        # Structured outputs: the grammar compiler (built on first use, from the engine's tokenizer) and one
        # matcher per constrained sequence.
        self.grammar_compiler = grammar_compiler
        self._guides: GuideStates | None = None
        self.prompt_passes = PromptPasses()  # prompt logprobs and embeddings being computed, chunk by chunk
        self.layered: LayeredChunk | None = None
        self.cold = cold
        self._tiered_layers = None if cold is None else cold.layers_over(kv_cache)
        if torch.device(device).type == "cpu":
            keep_freed_memory()
        self.backend: Backend = TorchBackend(device)  # what a model runs on until it is given a backend
        if backend is not None:
            self.set_backend(backend)
        self.graphs = None if graphs is None else self._capture(graphs, progress)
        self.dense = self._warm_dense(progress)

    @torch.inference_mode()
    def _capture(self, plan: GraphPlan, progress: Progress | None) -> DecodeGraphs | None:
        forward = lambda ids, positions, meta, layers: self.model(ids, positions, meta, layers)  # noqa: E731
        return DecodeGraphs.capture_or_none(plan, forward, self.kv_cache.layers, self.device, progress)

    def _warm_dense(self, progress: Progress | None) -> Callable | None:
        """The backend's fused sampler distribution (Backend.fuse), compiled now in every variant; None: plain."""
        dense = self.backend.fuse(dense_distribution)
        if dense is not None:
            warm_ups = dense_warm_ups(self.model.cfg.vocab_size, self.device)
            with torch.inference_mode():
                for args in counted(warm_ups, progress, COMPILING_SAMPLER, len(warm_ups)):
                    dense(*args)
        return dense

    def set_backend(self, backend: Backend) -> None:
        """Run the model on `backend` (which prepares its weights now). A model that runs on this very backend
        already (an actor's next engine around the same weights, after a role change) keeps its prepared copies."""
        self.backend = backend
        if getattr(getattr(self.model, "prepared", None), "backend", None) is not backend:
            self.model.set_backend(backend)

    @torch.inference_mode()
    def run(self, sched: SchedulerOutput, kv_cache: KVCache | None = None) -> RunnerOutput:
        """One forward over the scheduled chunks; `kv_cache` overrides the runner's own pages (a prefill actor
        computes straight into a decode actor's exported pool)."""
        kv_cache = kv_cache or self.kv_cache
        if sched.compressions:  # before anything writes this step: a moved hot block may already be reused
            self.cold.compress(kv_cache, sched.compressions)
        self.forget(sched.finished_seq_ids)
        self.prompt_passes.forget(sched.preempted_seq_ids)
        if sched.is_empty:
            return RunnerOutput()
        layers = self._layers(kv_cache, sched)
        inp = prepare_input(sched.chunks, kv_cache.block_size, self.device, self.backend.attends_in_place,
                            self._verify_as_rows(sched, layers))
        read = torch.cat([inp.sample_rows, inp.verify_rows, inp.prompt_rows])  # [B + R + P]: the rows to read
        every_row = len(read) == len(inp.input_ids)  # a decode step: no row to leave out
        hidden = self.graphs.run(inp, layers) if self.graphs is not None and every_row else None
        if hidden is None:
            hidden = self.model(inp.input_ids, inp.positions, inp.meta, layers,
                                keep_rows=None if every_row else read,
                                layer_metas=self._layer_metas(kv_cache, inp))  # [T or B + R + P, hidden]
        rows = hidden[read] if every_row else hidden
        num_read = len(inp.sample_rows) + len(inp.verify_rows)
        out = self._tokens(rows[:num_read], inp)
        if not inp.prompt_chunks:
            return out
        prompts = self.prompt_passes.add(inp.prompt_chunks, rows[num_read:], self.model)
        return dataclasses.replace(out, prompt_results=MappingProxyType(prompts)) if prompts else out

    @torch.inference_mode()
    def start_layered(self, chunk: ScheduledChunk) -> None:
        """Begin `chunk`'s forward, to run layer by layer (advance_layered) on the runner's own pages."""
        inp = prepare_input([chunk], self.kv_cache.block_size, self.device, self.backend.attends_in_place)
        self.layered = LayeredChunk(chunk, inp, self.model.begin_layers(inp.input_ids, inp.positions),
                                    self._layers(self.kv_cache, SchedulerOutput((chunk,))))

    @property
    def layers_left(self) -> int:
        return 0 if self.layered is None else len(self.layered.layers) - self.layered.state.next_layer

    @torch.inference_mode()
    def advance_layered(self, count: int) -> RunnerOutput | None:
        """The next `count` layers of the chunk in flight; once its last has run, what the chunk yields (its next
        token where it ends the prompt) and the chunk is done; None while layers are left."""
        work = self.layered
        self.model.run_layers(work.state, work.inp.meta, work.layers, count, keep_rows=work.inp.sample_rows)
        if self.layers_left:
            return None
        self.layered = None
        return self._tokens(self.model.end_layers(work.state), work.inp)

    def _tokens(self, rows: torch.Tensor, inp: ModelInput) -> RunnerOutput:
        """rows [B + R, hidden]: the sampled rows, then the verified ones -> the tokens they give."""
        if not inp.sampled_chunks and not inp.verified_chunks:
            return RunnerOutput()
        greedy = self._greedy_without_logits(rows, inp)
        if greedy is not None:
            return greedy
        logits = self.model.compute_logits(rows)  # [B + R, V] fp32
        num_sampled = len(inp.sampled_chunks)
        sampled, logprobs = self._sample(logits[:num_sampled], inp.sampled_chunks)
        if not inp.verified_chunks:
            return runner_output(sampled, logprobs)
        return runner_output(sampled, logprobs, *self._verify(logits[num_sampled:], inp.verified_chunks))

    @staticmethod
    def _layer_metas(kv_cache: KVCache, inp: ModelInput) -> list[AttentionMetadata] | None:
        """Each layer's metadata, its KV-cache group's; None where one group serves every layer."""
        if len(inp.group_metas) == 1:
            return None
        return [inp.group_metas[group] for group in kv_cache.groups.layer_groups]

    def forget(self, seq_ids: Iterable[int]) -> None:
        """Drop the per-sequence state (sampler generator, grammar matcher, prompt pass) of sequences that are
        done here."""
        seq_ids = list(seq_ids)
        if self.layered is not None and self.layered.chunk.seq_id in seq_ids:
            self.layered = None
        self.prompt_passes.forget(seq_ids)
        for seq_id in seq_ids:
            self.generators.pop(seq_id, None)
            if self._guides is not None:
                self._guides.drop(seq_id)

    def _greedy_without_logits(self, rows: torch.Tensor, inp: ModelInput) -> RunnerOutput | None:
        """A step whose rows all take their plain argmax (no drafts to verify): the picks straight off the LM
        head where the backend allows (LlamaModel.greedy_tokens), else None."""
        if inp.verified_chunks or not _plain_greedy(inp.sampled_chunks):
            return None
        tokens = self.model.greedy_tokens(rows)  # [B] or None
        if tokens is None:
            return None
        return runner_output(dict(zip((c.seq_id for c in inp.sampled_chunks), tokens.tolist())))

    def _verify_as_rows(self, sched: SchedulerOutput, layers: list) -> bool:
        """A step that only verifies one sequence's drafts, on plain pages: the decode-attention kernel then
        serves all its rows (measured for one sequence; several keep their causal segments)."""
        return (self.backend.attends_in_place and len(sched.chunks) == 1 and sched.chunks[0].num_draft > 0
                and isinstance(layers[0][0], torch.Tensor))

    def _layers(self, kv_cache: KVCache, sched: SchedulerOutput) -> list:
        """The plain pages unless this step reads compressed blocks of the runner's own pool."""
        if self.cold is None or kv_cache is not self.kv_cache \
                or not names_cold((c.block_table for c in sched.chunks), self.cold.first_cold):
            return kv_cache.layers
        return self._tiered_layers

    def _sample(self, logits: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> tuple[dict[int, int], dict]:
        """logits [B, V] of the sampling chunks: (seq_id -> token, seq_id -> logprobs where asked)."""
        if not chunks:
            return {}, {}
        batch = SamplingBatch.build([c.params for c in chunks], [self._generator(c) for c in chunks],
                                    [c.banned_token_ids for c in chunks], self.device, _histories(chunks),
                                    self._grammar(chunks))
        out = sample(logits, batch, self.backend.row_argmax, self.dense)
        ids = [c.seq_id for c in chunks]
        logprobs = {} if out.logprobs is None else {i: lp for i, lp in zip(ids, out.logprobs) if lp is not None}
        return dict(zip(ids, out.token_ids)), logprobs

    def _verify(self, logits: torch.Tensor, chunks: Sequence[ScheduledChunk]) -> tuple[dict[int, list[int]], dict]:
        """logits [R, V]: rows 0..num_draft of each chunk with drafts, in order. Returns (seq_id -> emitted
        tokens, seq_id -> their logprobs where asked)."""
        rows = [c for c in chunks for _ in range(c.num_draft + 1)]
        batch = SamplingBatch.build([c.params for c in rows], [None] * len(rows),
                                    [c.banned_token_ids for c in rows], self.device, _verify_histories(chunks),
                                    self._verify_grammar(chunks))
        verdict = self._verdict(logits, batch, chunks)
        tokens, num_accepted = verdict.tokens.tolist(), verdict.num_accepted.tolist()
        emitted = [tokens[b][:num_accepted[b] + 1] for b in range(len(chunks))]
        verified = {chunk.seq_id: chunk_tokens for chunk, chunk_tokens in zip(chunks, emitted)}
        if batch.max_logprobs is None:
            return verified, {}
        return verified, self._verified_logprobs(logits, batch, chunks, emitted)

    def _verdict(self, logits: torch.Tensor, batch: SamplingBatch, chunks: Sequence[ScheduledChunk]) -> Verdict:
        k = max(c.num_draft for c in chunks)
        sizes = [c.num_draft + 1 for c in chunks]
        drafts = torch.tensor([[*c.token_ids[1:], *[0] * (k - c.num_draft)] for c in chunks],
                              dtype=torch.long, device=self.device)  # [B, K]
        num_drafts = torch.tensor([c.num_draft for c in chunks], dtype=torch.long, device=self.device)
        if batch.all_greedy:  # the argmax alone decides: skip the [R, V] distributions
            target = torch.nn.utils.rnn.pad_sequence(list(greedy_tokens(logits, batch).split(sizes)),
                                                     batch_first=True)  # [B, K+1]
            return verify_greedy(target, drafts, num_drafts)
        probs = process_logits(logits, batch, self.dense)  # [R, V]: what plain sampling would draw at each position
        target = torch.nn.utils.rnn.pad_sequence(list(probs.split(sizes)), batch_first=True)  # [B, K+1, V]
        uniforms, noise = self._acceptance_noise(chunks, k, probs.shape[-1])
        return verify_drafts(target, drafts, self._draft_probs(chunks, drafts, probs.shape[-1]), num_drafts,
                             uniforms, noise)

    def _draft_probs(self, chunks: Sequence[ScheduledChunk], drafts: torch.Tensor, vocab: int) -> torch.Tensor | None:
        """[B, K, V], point masses for chunks without distributions; None when every draft is a point mass."""
        if all(c.draft_probs is None for c in chunks):
            return None
        q = F.one_hot(drafts, vocab).float()  # [B, K, V]
        for b, c in enumerate(chunks):
            if c.draft_probs is not None:
                q[b, :c.num_draft] = c.draft_probs.to(device=self.device, dtype=q.dtype)
        return q

    def _acceptance_noise(self, chunks: Sequence[ScheduledChunk], k: int,
                          vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Uniforms [B, K] and Exp(1) noise [B, V] from each sequence's own generator; greedy rows get 0 and 1
        (no randomness: accept iff the draft is the argmax, then take the argmax)."""
        uniforms = torch.zeros(len(chunks), k, device=self.device)
        noise = torch.ones(len(chunks), vocab, device=self.device)
        for b, c in enumerate(chunks):
            if not c.params.greedy:
                gen = self._generator(c)
                uniforms[b, :c.num_draft].uniform_(generator=gen)
                noise[b].exponential_(generator=gen)
        return uniforms, noise.clamp_(min=torch.finfo(noise.dtype).tiny)

    def _verified_logprobs(self, logits: torch.Tensor, batch: SamplingBatch, chunks: Sequence[ScheduledChunk],
                           emitted: list[list[int]]) -> dict[int, list]:
        """seq_id -> the logprobs of its emitted tokens, for the chunks that asked for logprobs."""
        # Row j of a chunk scores the j-th emitted token; rows past the emitted ones score a dummy token 0.
        row_tokens = [t for c, toks in zip(chunks, emitted) for t in toks + [0] * (c.num_draft + 1 - len(toks))]
        lps = token_logprobs(logits, torch.tensor(row_tokens, device=self.device), batch)
        starts = itertools.accumulate((c.num_draft + 1 for c in chunks), initial=0)
        return {c.seq_id: lps[start:start + len(toks)]
                for c, toks, start in zip(chunks, emitted, starts) if c.params.logprobs is not None}

    def guides(self) -> GuideStates:
        if self._guides is None:
            if self.grammar_compiler is None:
                raise RuntimeError("this runner was given no grammar compiler")
            self._guides = GuideStates(self.grammar_compiler())
        return self._guides

    def _grammar(self, chunks: Sequence[ScheduledChunk]) -> tuple[list[int], torch.Tensor] | None:
        """(rows, bitmask) of the sampling chunks under a grammar or a thinking budget; None when no chunk is."""
        rows = [row for row, c in enumerate(chunks) if c.params.masks_tokens]
        if not rows:
            return None
        masks = []
        for r in rows:
            c, output = chunks[r], chunks[r].history[chunks[r].num_prompt_tokens:]
            mask = self._open_mask(1) if c.params.guide is None else \
                self.guides().bitmask([(c.seq_id, c.params.guide, output)])
            masks.append(_budgeted(mask, c.params.thinking_budget, output, ()))
        return rows, torch.cat(masks)

    def _verify_grammar(self, chunks: Sequence[ScheduledChunk]) -> tuple[list[int], torch.Tensor] | None:
        """(rows, bitmask) of the verified rows under a grammar or a thinking budget: row j of a chunk allows what
        may follow the sequence's tokens and its first j drafts, so each draft is judged by the state plain
        decoding would have reached, and a draft the grammar forbids has target probability 0 (rejected)."""
        if not any(c.params.masks_tokens for c in chunks):
            return None
        rows: list[int] = []
        masks: list[torch.Tensor] = []
        start = 0
        for c in chunks:
            if c.params.masks_tokens:
                rows.extend(range(start, start + c.num_draft + 1))
                output, drafts = c.history[c.num_prompt_tokens:], c.token_ids[1:1 + c.num_draft]
                mask = self._open_mask(c.num_draft + 1) if c.params.guide is None else \
                    self.guides().draft_bitmask(c.seq_id, c.params.guide, output, drafts)
                masks.append(_budgeted(mask, c.params.thinking_budget, output, drafts))
            start += c.num_draft + 1
        return rows, torch.cat(masks)

    def _open_mask(self, num_rows: int) -> torch.Tensor:
        """int32 [num_rows, words] allowing every token of the vocabulary."""
        return torch.full((num_rows, (self.model.cfg.vocab_size + 31) // 32), -1, dtype=torch.int32)

    def _generator(self, chunk: ScheduledChunk) -> torch.Generator | None:
        """The sequence's generator, re-seeded for the position this chunk samples (step.position_seed)."""
        if chunk.seed is None or chunk.params.greedy:
            return None
        gen = self.generators.get(chunk.seq_id)
        if gen is None:
            gen = self.generators[chunk.seq_id] = torch.Generator(device=self.device)
        return gen.manual_seed(position_seed(chunk.seed, chunk.sample_position))
