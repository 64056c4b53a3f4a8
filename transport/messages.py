"""Every message that crosses a process boundary, in one module.

Each message is a frozen dataclass with a stable wire tag (`TAG`); `MESSAGE_TYPES` maps tag -> class and is
built from this module's classes at import. Tags are part of the protocol: never rename or reuse one. Adding,
removing or reordering fields of a message changes the wire format, so bump `PROTOCOL_VERSION` with it (peers
compare versions in `Hello`).

Field types are restricted to what msgpack carries natively (the codec checks them against these annotations):
`int` (64-bit), `float`, `str`, `bytes`, `bool`, `None`, `list[T]`, `dict[str, T]`, `Any` (any nesting of those,
depth-limited), and `Record` subclasses, which travel as positional arrays (compact rows). Large tensors never
travel as lists of numbers: KV pages go through shared memory / CUDA IPC, or as one `bytes` payload over TCP.

Conventions:
- ids: `request_id` is the router's request id (str); `actor_id` names an actor ("decode-0").
- times are seconds. `deadline` is an absolute Unix time (`time.time()`), None = no deadline; peers on other
  hosts need synchronised clocks (NTP), and should treat a deadline already in the past as expired.
- `sampling` is the request's `SamplingParams` as a dict of its fields (tuples as lists; `logit_bias` as
  `[[token_id, bias], ...]`; `guide` as None or `{"kind", "source", "choices"}`: the constraint's source text,
  which the receiving actor compiles itself).

Flows (router = main process):
- start-up:   actor -> Hello, actor -> StartupProgress ... while it loads, actor -> Ready (model loaded, KV pool
              exported). The supervisor gives up on an actor that sends nothing for a while, not after a total time.
- liveness:   router -> Heartbeat, actor -> HeartbeatAck (with the actor's EngineStats).
- colocated:  router -> AddRequest, actor -> TokenUpdates ..., router -> AbortRequest when a client leaves.
- hand-off:   router -> ReserveBlocks (decode) -> BlocksReserved | ReservationFailed;
              router -> PrefillRequest (prefill) -> [pages for a decode actor on another host] -> KVReady |
              RequestFailed; router -> AddRequest(prefilled=True, first_token) (decode), or ReleaseReservation.
- pages to another host: straight from the prefill actor on its kept-open connection to the decode actor's
              KV endpoint (KVPageFrame + raw bytes ..., KVStreamEnd -> KVStreamAck, then KVReady), or relayed
              by the router as KVPages when the decode actor offers no endpoint.
- drafting:   decode actor -> ProposeDrafts (draft actor) -> DraftProposals; decode actor -> ReleaseDrafts.
- migration:  a stream whose decode actor died or drains is resumed elsewhere: AddRequest (or the hand-off's
              messages) with `resume`, the tokens the client already has.
- role change: router -> ChangeRole (to an actor the router has moved every request off), actor -> RoleChanged
              once its engine of the new role runs on the weights it already holds (with its new Ready).
- cores:      router -> SetCores (an actor takes its idle peers' cores, or gives them back), actor -> CoresSet
              once its steps run on them.
- stop:       router -> Drain (finish running work, accept none), router -> Shutdown; either side -> Error.
              An actor sent SIGTERM says Leaving; the router moves its streams off, then sends Shutdown.
"""
from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, is_dataclass
from types import MappingProxyType
from typing import Any, ClassVar

# 16: SetCores, CoresSet (an actor's threads and cores change while it serves: elastic merges)
# 15: EngineStats carries the KV tiers' counters (kv_host_*, kv_disk_*, kv_tier_*)
# 14: TokenUpdate.prompt_logprobs and .embedding (a request's prompt pass); `sampling` carries prompt_logprobs
#     and pooling
# 13: ChangeRole, RoleChanged (an actor switches between prefill and decode on its loaded model)
# 12: StartupProgress (an actor greets as it starts and reports each stage until Ready)
# 11: Ready.step_tokens; 10: `sampling` carries truncate_prompt_tokens
# 9: Hello.node_id, node_address (where an actor runs); KVReady.stream_seconds (each link's measured cost)
# 8: KVReady.streamed_bytes; KVPageFrame, KVStreamEnd, KVStreamAck (direct KV streams, out-of-band pages)
# 7: AddRequest.resume, PrefillRequest.num_prompt_tokens (migrated streams), Leaving; no generator_state
# 6: `guide.kind` may be structural_tag (tool calls); 5: `sampling` carries `guide`
PROTOCOL_VERSION = 16

KV_EXPORT_KINDS = ("shm", "cuda_ipc", "tcp", "none")
"""`Ready.kv_export["kind"]`: how peers map the actor's KV pool, or (`tcp`, with `host` and `port`) where
a decode actor on another host takes streamed pages (transport.kv_stream). A shared pool that also has such an
endpoint (a decode actor on a Ray node) keeps its kind and adds `endpoint: [host, port]`: peers on its node map
the pool, peers on other nodes stream to the endpoint."""


@dataclass(frozen=True, slots=True)
class Record:
    """A positional struct on the wire: a msgpack array of its field values in declaration order."""


@dataclass(frozen=True, slots=True)
class Message(Record):
    """A top-level wire message; subclasses set a unique, stable `TAG`."""

    TAG: ClassVar[str] = ""


# ---- rows (Records nested inside messages) --------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class TopLogprob(Record):
    """One alternative token and its log-probability; on the wire `[token_id, logprob]`."""

    token_id: int
    logprob: float


@dataclass(frozen=True, slots=True)
class PromptLogprob(Record):
    """One prompt token's log-probability at its position, its rank there (1 = the likeliest) and the likeliest
    tokens; on the wire `[token_id, logprob, rank, top_logprobs]`."""

    token_id: int
    logprob: float
    rank: int
    top_logprobs: list[TopLogprob]


@dataclass(frozen=True, slots=True)
class SpecCount(Record):
    """Speculative decoding of one sample: `[draft tokens verified, accepted, verification steps]`."""

    proposed: int
    accepted: int
    steps: int


@dataclass(frozen=True, slots=True)
class Treatment(Record):
    """What the engine does for one request beyond its sampling parameters, chosen per quadrant by the server
    (server.quadrant.treatment_for) and carried by EngineRequest and AddRequest; `engine.core.treatment`
    re-exports it. `speculate`: speculative decoding on/off, None = the engine's default (on when a proposer
    is configured). `compress_first`: with --kv-compress, this request's old pages are compressed before
    other requests'. `long_prompt`: its quadrant is long-in, so its prefill shares each step with short prompts
    (engine/scheduler/shares.py); None = judged by the prompt's length."""

    speculate: bool | None = None
    compress_first: bool = False
    long_prompt: bool | None = None


@dataclass(frozen=True, slots=True)
class EngineStats(Record):
    """An engine's queues, KV pool and cumulative counters: the one record, under the same field names, from the
    engine (`engine.core.stats` re-exports it) through the heartbeat to the router's totals, /status and /metrics."""

    running: int = 0
    waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_preemptions: int = 0
    spec_proposed: int = 0  # draft tokens verified
    spec_accepted: int = 0  # ... of which accepted
    spec_steps: int = 0  # verifications (one sequence, one step, at least one draft)
    kv_bytes_per_token: float = 0.0  # KV pool bytes per cached token (smaller with --kv-cache-dtype fp8/fp4)
    kv_blocks_compressed: int = 0  # --kv-compress: FP4 blocks holding compressed pages now
    kv_blocks_cold_total: int = 0  # ... of this many in the FP4 region (not counted in kv_blocks_total)
    kv_compressions: int = 0  # pages compressed so far
    # The KV tiers below the pool (engine/kv/tiers.py), per tier: blocks looked up there (past the pool and the
    # tiers above), blocks loaded from it, bytes loaded and stored by this engine, and the tier's bytes in use and
    # capacity (shared by every engine of the host: a property of the tier, not a count)
    kv_host_queries: int = 0
    kv_host_hits: int = 0
    kv_host_bytes_loaded: int = 0
    kv_host_bytes_stored: int = 0
    kv_host_bytes_used: int = 0
    kv_host_bytes_total: int = 0
    kv_disk_queries: int = 0
    kv_disk_hits: int = 0
    kv_disk_bytes_loaded: int = 0
    kv_disk_bytes_stored: int = 0
    kv_disk_bytes_used: int = 0
    kv_disk_bytes_total: int = 0
    kv_tier_dropped_stores: int = 0  # evicted blocks not written back: the queue was full, or a tier's disk
    kv_tier_bad_entries: int = 0  # tier entries found truncated, corrupt or foreign, read as misses

    @staticmethod
    def total(parts: Iterable[EngineStats]) -> EngineStats:
        """Several engines as one: counts add up; bytes per token and a tier's bytes in use and capacity are the
        largest (properties, not counts: engines share their tiers)."""
        parts = list(parts)
        sums = {f.name: sum(getattr(p, f.name) for p in parts) for f in fields(EngineStats)}
        sums["kv_bytes_per_token"] = max((p.kv_bytes_per_token for p in parts), default=0.0)
        for name in SHARED_TIER_FIELDS:
            sums[name] = max((getattr(p, name) for p in parts), default=0)
        return EngineStats(**sums)


SHARED_TIER_FIELDS = ("kv_host_bytes_used", "kv_host_bytes_total", "kv_disk_bytes_used", "kv_disk_bytes_total")


@dataclass(frozen=True, slots=True)
class TokenUpdate(Record):
    """One step of one sample: a new token and/or the end of the sample. On the wire a compact row:
    `[request_id, sample_index, token_id, finish_reason, logprob, top_logprobs, num_prompt_tokens,
    num_cached_tokens, spec, prompt_logprobs, embedding]`. `token_id` is None when only the finish is reported
    (e.g. aborted); `spec` is set only on the row that finishes a speculating sample. On the first token of a
    request that asked for its prompt pass's outputs: `prompt_logprobs` for prompt positions 1.. (position 0 has
    none), and `embedding` as little-endian float32 bytes."""

    request_id: str
    sample_index: int
    token_id: int | None
    finish_reason: str | None = None
    logprob: float | None = None
    top_logprobs: list[TopLogprob] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    spec: SpecCount | None = None
    prompt_logprobs: list[PromptLogprob] | None = None
    embedding: bytes | None = None


# ---- start-up and liveness ------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Hello(Message):
    """First message of an actor on a new connection: who it is."""

    TAG: ClassVar[str] = "hello"
    role: str  # "prefill" | "decode" | "draft"
    device: str  # "cuda:0", "cpu"
    pid: int
    actor_id: str
    protocol_version: int = PROTOCOL_VERSION
    # Where it runs: peers with the same node id share memory (KV pages by shared memory, else over TCP).
    # A Ray node id on a Ray cluster, else "host:HOSTNAME"; the address is the node's IP ("" when unknown).
    node_id: str = ""
    node_address: str = ""


@dataclass(frozen=True, slots=True)
class Ready(Message):
    """The actor loaded its model and exported its KV pool; it now accepts work.

    `kv_export` describes the pool for peers that write into it: `{"kind": one of KV_EXPORT_KINDS,
    "name": str (shm segment) | None, "handle": bytes (CUDA IPC) | None, "shape": [int, ...],
    "dtype": str, ...}`; the actor engineer owns the exact keys (layout per layer, scales)."""

    TAG: ClassVar[str] = "ready"
    actor_id: str
    num_kv_blocks: int
    block_size: int
    kv_export: dict[str, Any]
    calibration: dict[str, Any] | None = None  # {"prefill": [[tokens, seconds], ...], "decode": [[batch, s], ...]}
    backend: dict[str, Any] | None = None  # the engine's Backend.describe(): which backend and kernels run
    step_tokens: int | None = None  # the engine's token budget per step, for the router's TTFT estimate


@dataclass(frozen=True, slots=True)
class StartupProgress(Message):
    """Between Hello and Ready: how far the actor's start has come. `stage` names what it does now ("loading
    weights", "calibrating"); `done` of `total` units (`unit`: "tensors", "runs") where the stage counts them,
    total 0 where it does not. Every message counts as a sign of life: the supervisor gives up on silence."""

    TAG: ClassVar[str] = "startup_progress"
    actor_id: str
    stage: str
    done: int = 0
    total: int = 0
    unit: str = ""

    def describe(self) -> str:
        """'loading weights 120/291 tensors', or the stage alone where it has no count."""
        if not self.total:
            return self.stage
        return f"{self.stage} {self.done}/{self.total}" + (f" {self.unit}" if self.unit else "")


@dataclass(frozen=True, slots=True)
class Heartbeat(Message):
    TAG: ClassVar[str] = "heartbeat"
    seq: int
    time: float


@dataclass(frozen=True, slots=True)
class HeartbeatAck(Message):
    """Answers `Heartbeat(seq)` with the actor's stats; `time` echoes the heartbeat's, for round-trip time."""

    TAG: ClassVar[str] = "heartbeat_ack"
    seq: int
    time: float
    stats: EngineStats


# ---- requests -------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class AddRequest(Message):
    """Schedule a request. With `prefilled` (a finished hand-off), the prompt's KV is already in the blocks the
    actor reserved for this request id: it skips prefill and starts decoding after `first_token`."""

    TAG: ClassVar[str] = "add_request"
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    priority: int = 0
    arrival_time: float = 0.0
    deadline: float | None = None
    prefilled: bool = False
    first_token: int | None = None
    first_logprob: float | None = None
    first_top_logprobs: list[TopLogprob] | None = None
    checksum: int | None = None  # crc32 of the KV the prefill actor wrote; verified before decoding
    treatment: Treatment = Treatment()
    # A stream resumed after its decode actor died or drained: [[sample index, [tokens it already emitted]], ...]
    resume: list[list[Any]] | None = None


@dataclass(frozen=True, slots=True)
class AbortRequest(Message):
    """Stop a request (all samples, or one) and free its blocks; the actor answers with finish rows."""

    TAG: ClassVar[str] = "abort_request"
    request_id: str
    sample_index: int | None = None


@dataclass(frozen=True, slots=True)
class TokenUpdates(Message):
    """Everything one engine step produced, for all its requests, in one frame. `trace` (serve --trace-tokens
    only): [step done, frame sent], on the host's monotonic clock."""

    TAG: ClassVar[str] = "token_updates"
    updates: list[TokenUpdate]
    trace: list[float] | None = None


@dataclass(frozen=True, slots=True)
class RequestFailed(Message):
    """The actor cannot finish this request. `retryable` means no token was streamed and it may run elsewhere.
    `param`: the engine refused the request itself (engine.core.errors.RequestError), naming this field; the
    client gets that refusal, not a failure."""

    TAG: ClassVar[str] = "request_failed"
    request_id: str
    reason: str
    retryable: bool
    param: str | None = None


# ---- KV hand-off ----------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ReserveBlocks(Message):
    """Ask a decode actor to hold blocks for a prompt's KV until `deadline`. Blocks already in its prefix cache
    (found by the prompt's chained block hashes, which the actor computes) are reused and not transferred."""

    TAG: ClassVar[str] = "reserve_blocks"
    request_id: str
    prompt_token_ids: list[int]
    deadline: float | None


@dataclass(frozen=True, slots=True)
class BlocksReserved(Message):
    """All of the request's blocks, in order; the first `num_cached_tokens // block_size` hold cached KV."""

    TAG: ClassVar[str] = "blocks_reserved"
    request_id: str
    block_ids: list[int]
    num_cached_tokens: int


@dataclass(frozen=True, slots=True)
class ReservationFailed(Message):
    TAG: ClassVar[str] = "reservation_failed"
    request_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class ReleaseReservation(Message):
    """Give reserved blocks back (hand-off failed or timed out); idempotent."""

    TAG: ClassVar[str] = "release_reservation"
    request_id: str


@dataclass(frozen=True, slots=True)
class PrefillRequest(Message):
    """Prefill a prompt on a prefill actor and write its KV into `dest_block_ids` of `dest_actor_id`'s pool,
    skipping the first `skip_blocks` blocks (already cached there)."""

    TAG: ClassVar[str] = "prefill_request"
    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    dest_actor_id: str
    dest_block_ids: list[int]
    skip_blocks: int
    deadline: float | None
    stream: bool = False  # the destination is on another host: send its pages (KVPages) instead of writing them
    kv_format: str = "auto"  # the destination pool's page format (what streamed pages must be in)
    num_prompt_tokens: int | None = None  # a resumed stream: the prompt's share of prompt_token_ids (the rest
    # are tokens it already emitted, which penalties and grammars count as output)


@dataclass(frozen=True, slots=True)
class KVPages(Message):
    """One layer's pages for some blocks, for peers on another host (same host: shared memory instead).
    `payload` is the raw page bytes (K then V, scales beside quantised pages) in the pool's layout
    (engine.kv.cache.KVCache.read_pages). Prefill actor -> router -> decode actor, before KVReady."""

    TAG: ClassVar[str] = "kv_pages"
    request_id: str
    layer: int
    block_ids: list[int]
    payload: bytes


@dataclass(frozen=True, slots=True)
class KVPageFrame(Message):
    """On a direct KV stream (prefill actor -> decode actor on another host): one layer's pages of some blocks
    follow this frame as `num_bytes` raw bytes, out of band (laid out as KVPages.payload)."""

    TAG: ClassVar[str] = "kv_page_frame"
    request_id: str
    layer: int
    block_ids: list[int]
    num_bytes: int


@dataclass(frozen=True, slots=True)
class KVStreamEnd(Message):
    """On a direct KV stream: every page of the request was sent, `num_bytes` in all; answered by KVStreamAck."""

    TAG: ClassVar[str] = "kv_stream_end"
    request_id: str
    num_bytes: int


@dataclass(frozen=True, slots=True)
class KVStreamAck(Message):
    """The decode actor wrote `num_bytes` of the request's pages into its reserved blocks; `error` says why not
    all (no live reservation, pages refused), None when every page it was sent is in."""

    TAG: ClassVar[str] = "kv_stream_ack"
    request_id: str
    num_bytes: int
    error: str | None = None


@dataclass(frozen=True, slots=True)
class KVReady(Message):
    """The prefill actor finished writing the KV; `checksum` over the `num_bytes` written lets the decode
    actor refuse a corrupt transfer instead of producing garbage."""

    TAG: ClassVar[str] = "kv_ready"
    request_id: str
    first_token: int
    logprob: float | None
    top_logprobs: list[TopLogprob] | None
    num_bytes: int
    checksum: int
    num_cached_tokens: int = 0  # prompt tokens the destination already had (not computed, not written)
    streamed_bytes: int = 0  # page bytes the destination acknowledged over a direct stream (another host)
    stream_seconds: float = 0.0  # how long the direct stream was busy with them (the router learns links from it)


@dataclass(frozen=True, slots=True)
class AttachPool(Message):
    """Tell a prefill actor how to map a decode actor's exported KV pool (sent whenever that actor is ready)."""

    TAG: ClassVar[str] = "attach_pool"
    actor_id: str
    kv_export: dict[str, Any]
    num_blocks: int
    block_size: int


@dataclass(frozen=True, slots=True)
class CheckIntegrity(Message):
    """Ask an actor to verify its block bookkeeping (tests and operators; O(blocks), so not per heartbeat)."""

    TAG: ClassVar[str] = "check_integrity"


@dataclass(frozen=True, slots=True)
class IntegrityReport(Message):
    """`error` is None when every invariant holds; counts let a caller spot leaked blocks or reservations."""

    TAG: ClassVar[str] = "integrity_report"
    actor_id: str
    error: str | None
    used_blocks: int
    cached_blocks: int
    reservations: int
    running: int


@dataclass(frozen=True, slots=True)
class DetachPool(Message):
    """A decode actor went away: drop its pool and fail the prefills that were writing into it."""

    TAG: ClassVar[str] = "detach_pool"
    actor_id: str


# ---- speculative decoding (decode actor -> draft actor) -------------------------------------------------

@dataclass(frozen=True, slots=True)
class DraftQuery(Record):
    """One sequence to draft for. The draft actor mirrors each sequence's tokens per connection: it keeps the
    first `num_kept` tokens it was sent before, appends `new_token_ids`, and rolls its KV back to whatever of it
    still agrees (rejected drafts). `sampling` and `seed` come with a sequence's first query only (num_kept 0)."""

    seq_id: int
    num_kept: int
    new_token_ids: list[int]
    k: int
    sampling: dict[str, Any] | None = None
    seed: int | None = None


@dataclass(frozen=True, slots=True)
class ProposeDrafts(Message):
    """Ask for up to `k` draft tokens per query; answered by `DraftProposals` with the same `call_id`. After
    `deadline` the answer is useless: the actor only updates its mirrors and proposes nothing."""

    TAG: ClassVar[str] = "propose_drafts"
    call_id: int
    queries: list[DraftQuery]
    deadline: float | None


@dataclass(frozen=True, slots=True)
class DraftProposal(Record):
    """`probs`: the distributions the tokens were drawn from, raw little-endian `probs_dtype` bytes of shape
    `[len(token_ids), vocab_size]`; None for greedy requests (point masses)."""

    seq_id: int
    token_ids: list[int]
    probs: bytes | None = None


@dataclass(frozen=True, slots=True)
class DraftProposals(Message):
    """One proposal per query, in order. `resync` lists sequences the actor has no consistent state for: the
    client resends them in full (num_kept 0, with sampling)."""

    TAG: ClassVar[str] = "draft_proposals"
    call_id: int
    proposals: list[DraftProposal]
    vocab_size: int
    probs_dtype: str  # "float32" | "float16"
    resync: list[int]


@dataclass(frozen=True, slots=True)
class ReleaseDrafts(Message):
    """These sequences finished or were preempted: drop their draft state and KV (idempotent)."""

    TAG: ClassVar[str] = "release_drafts"
    seq_ids: list[int]


# ---- lifecycle ------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ChangeRole(Message):
    """Take `role` ("prefill" or "decode") without a restart: drop the engine of the old role and build one of the
    new role around the model already loaded (no checkpoint is read again). The router sends it only once no
    request is placed on the actor any more. `share_kv`: as a decode actor, export the KV pool for prefill actors
    (ActorSpec.share_kv). `calibration`: the new role's curves from an earlier time in it (Calibration.to_wire),
    reused after a warm-up; None: remembered on disk or measured."""

    TAG: ClassVar[str] = "change_role"
    role: str
    share_kv: bool = False
    calibration: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class RoleChanged(Message):
    """The actor now plays `role`; `ready` is what it would have sent at start in that role (its KV pool, its
    calibration). An actor whose change fails says Error and exits, and its supervisor restarts it in its old role."""

    TAG: ClassVar[str] = "role_changed"
    actor_id: str
    role: str
    ready: Ready
    seconds: float = 0.0  # from ChangeRole to the new engine serving


@dataclass(frozen=True, slots=True)
class SetCores(Message):
    """Run on these cores with this many threads from the next step on (the requests the actor holds stay). The
    router widens an actor onto the cores of peers it has stopped placing work on, and narrows it back before they
    serve again. `cpus` empty: leave the affinity as it is."""

    TAG: ClassVar[str] = "set_cores"
    threads: int
    cpus: list[int]


@dataclass(frozen=True, slots=True)
class CoresSet(Message):
    """The actor's steps run with `threads` threads on `cpus` now; or, with `error`, why it could not change them
    (its cores are then as they were)."""

    TAG: ClassVar[str] = "cores_set"
    actor_id: str
    threads: int
    cpus: list[int]
    seconds: float = 0.0  # from SetCores to the change taking effect (the step in flight ends first)
    error: str = ""


@dataclass(frozen=True, slots=True)
class Drain(Message):
    """Finish running requests, accept no new ones."""

    TAG: ClassVar[str] = "drain"


@dataclass(frozen=True, slots=True)
class Leaving(Message):
    """The actor was asked to stop (SIGTERM): move its requests elsewhere, then send Shutdown. It stops by
    itself after `deadline` (Unix time) if no Shutdown comes."""

    TAG: ClassVar[str] = "leaving"
    actor_id: str
    deadline: float


@dataclass(frozen=True, slots=True)
class Shutdown(Message):
    TAG: ClassVar[str] = "shutdown"


@dataclass(frozen=True, slots=True)
class Error(Message):
    """A peer reports a problem that is not about one request (e.g. a protocol version mismatch)."""

    TAG: ClassVar[str] = "error"
    message: str


def _collect_messages(namespace: Mapping[str, object]) -> Mapping[str, type[Message]]:
    classes = [v for v in namespace.values()
               if isinstance(v, type) and issubclass(v, Message) and v is not Message]
    registry: dict[str, type[Message]] = {}
    for cls in classes:
        if not cls.TAG or cls.TAG in registry or not is_dataclass(cls):
            raise TypeError(f"message {cls.__name__}: missing, duplicate or non-dataclass tag {cls.TAG!r}")
        registry[cls.TAG] = cls
    return MappingProxyType(registry)


MESSAGE_TYPES: Mapping[str, type[Message]] = _collect_messages(vars(sys.modules[__name__]))
"""tag -> message class, for every message in this module."""
