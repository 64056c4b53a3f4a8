"""Iteration-level scheduling: which tokens of which sequences run in the next forward pass.

Every step spends a token budget: running sequences first (decode tokens before prefill chunks), then new
or preempted sequences from the waiting queue. A prompt token costs more of it the deeper into its prompt it
stands (its attention over the context, SchedulerLimits.chunk_cost), so steps cost about the same all through a
long prefill. A running long prefill leaves a share of each step to short prompts that are ready to start, and
takes back what they leave (shares.py: stall-free batching). With an ITL target, a step that carries decodes spends
only the budget that its measured costs fit in that time (step_times.py), so a long prompt's chunks never stretch
the decoding streams' gaps past it. When the KV pool runs dry the lowest-priority running
sequence is preempted by recompute: its blocks are freed and it re-enters the waiting queue keeping its
sampled tokens, so it later resumes exactly where it stopped (often from the prefix cache).

Speculative decoding: a speculating sequence's decode step reserves budget and blocks for K draft tokens
after its last token (a verification chunk of 1 + K tokens); the engine's speculator returns the step with
the drafts added (Speculator.add_drafts), and that is the step the runner runs and update() reads.
After verification the sequence keeps the accepted drafts plus the target's own next token; the KV slots of
rejected drafts are simply overwritten later, blocks beyond the sequence's length are freed, and only blocks
whose tokens are final are registered in the prefix cache.

Adaptive compression (--kv-compress): with a compactor, a running sequence that cannot get its blocks first
has old pages of running sequences compressed into the FP4 region (engine/kv/compaction.py); only when that
cannot cover the shortfall is anyone preempted. The step's output lists the moves for the runner. Admission
never compresses: doing so only moved the shortage onto the running sequences, which were then preempted
(tiny model, 16 prompts, 64 blocks: 6 preemptions against none); the hot blocks that compaction frees as
running sequences grow are what admits newcomers.

KV-cache groups (engine/kv/groups.py): a sequence holds one block table per group, grown together. After
every step, a windowed group gives back the blocks that lie wholly before the window of the sequence's
next query (num_computed_tokens): no later query is older, since verification only ever rolls back to
positions after it, so rejected drafts never need them. A prefix-cache hit takes the longest prefix that
every group can serve: a full group needs all its blocks, a windowed one only those inside the window of
the first position it computes.

The parts, each with one concern, behind Scheduler's schedule() / update():
- scheduler.py: `Scheduler`, the step's plan turned into chunks, and the runner's results applied (tokens,
  finishing, speculative verification).
- planning.py: `RunningPlanner` (running sequences, compaction, preemption) and `Admission` (the waiting queue).
- shares.py: which prompts are long, and the rule that shares a step's prefill budget between long and short.
- blocks.py: `SequenceBlocks`, each sequence's block tables in the pool: growth, trimming, the window's
  release, the prefix cache (registering full blocks, attaching a cached prefix).
- queues.py: `SequenceQueues`, waiting / running / per request, and the status changes between them.
- remote.py: `RemoteReservations`, blocks held for KV that a prefill actor writes.
- step_times.py: `StepTimes`, what a decode step and a prefill budget unit take, learnt from the steps run.
"""
from engine.scheduler.planning import SchedulerLimits
from engine.scheduler.scheduler import Scheduler

__all__ = ["Scheduler", "SchedulerLimits"]
