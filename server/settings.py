"""The server's own settings and its actor flags (the engine's live in engine.config.EngineConfig). The `serve`
flags are generated from these fields (engine.flags)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from actors.ray_options import RayOptions, parse_resources
from actors.start_watch import DEFAULT_START_SILENCE
from engine.config import ConfigError
from engine.flags import option, parse_bytes, parse_list
from engine.core.stream_interval import AUTO_MAX_TOKENS, AUTO_MAX_WAIT_S, AUTO_OUTPUTS_PER_SECOND, StreamInterval
from engine.sampling.fields import generation_config_names
from engine.sampling.sampling_params import SamplingParams
from server.quadrant import QuadrantThresholds, SpeculateQuadrants, check_speculate_quadrants
from server.responses_store import StoreLimits

DEFAULT_MAX_BODY_BYTES = 4 << 20
API_KEY_ENV = "PHASE_SERVE_API_KEY"

DisaggMode = Literal["auto", "always", "never"]
ToolCallParserName = Literal["auto", "hermes", "llama3", "mistral"]
ReasoningParserName = Literal["auto", "deepseek_r1", "qwen3", "none"]
GenerationConfigMode = Literal["auto", "none"]


def _generation_config_help() -> str:
    *names, last = generation_config_names(SamplingParams)
    return (f"auto: a Hugging Face folder's generation_config.json sets the defaults of {', '.join(names)} and "
            f"{last} for requests that leave them out; none: OpenAI's defaults")


@dataclass(frozen=True)
class ServerSettings:
    """The HTTP server's settings: its `serve` flags, and limits set in code (max_body_bytes) or from the served
    model's context (quadrants)."""

    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on (0: any free port; the start-up line says which)")
    api_key: str | None = option(None, "require the key on /v1/* ('Authorization: Bearer KEY' or 'x-api-key: KEY')",
                                 shown=f"${API_KEY_ENV}, else none")
    max_queue: int = option(256, "requests in flight (waiting + running) before new ones get 429")
    served_model_name: str | None = option(None, "the model name clients send", shown="the model's name")
    grace_period: float = option(30.0, "seconds in-flight requests get to finish on SIGINT/SIGTERM before they "
                                 "are aborted")
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    quadrants: QuadrantThresholds = field(default_factory=QuadrantThresholds)
    speculate_quadrants: SpeculateQuadrants = option(
        "silo", "with --speculative: which requests speculate, SILO ones only (short in, long out: bound by "
        "inter-token latency) or all")
    trace_tokens: bool = option(False, "debugging: every stream chunk carries `phase_serve_trace`, the times its "
                                "tokens left the engine step, were sent, received, detokenised and written "
                                "(time.monotonic(); python -m bench.serve_latency --trace reads them)")
    stream_interval: str = option(
        "auto", f"new tokens a stream's event waits for: a number (1: every token), or auto: every token while "
        f"the streams' events stay under about {AUTO_OUTPUTS_PER_SECOND} a second, then fewer events per stream as "
        f"more run (at most {AUTO_MAX_TOKENS} tokens each, none held past {AUTO_MAX_WAIT_S:g} s); first tokens and "
        f"finishes are never held", metavar="N|auto")

    tool_call_parser: ToolCallParserName = option(
        "auto", "how tool calls are read from the output: hermes (<tool_call> JSON; Qwen), llama3 (JSON, "
        "<|python_tag|>), mistral ([TOOL_CALLS]); auto: from the chat template, else the architecture, else hermes")
    reasoning_parser: ReasoningParserName = option(
        "auto", "how a model's thinking (<think>...</think>) is told from its answer, which chat replies give as "
        "reasoning_content and content: qwen3 (the output opens the block, or the prompt does), deepseek_r1 (the "
        "output thinks until </think> even without opening the block), none; auto: when the chat template writes "
        "<think> or the vocabulary has both tags as tokens, deepseek_r1 if the template's generation prompt opens "
        "the block, else qwen3")
    default_max_tokens: int | None = option(
        None, "max_tokens of a request that sends none (chat: else the rest of the context; completions: else 16)",
        shown="none")
    generation_config: GenerationConfigMode = option("auto", _generation_config_help())
    responses_store_entries: int = option(StoreLimits.entries, "responses /v1/responses keeps for GET and "
                                          "previous_response_id (store: true); the oldest are dropped first")
    responses_store_bytes: int = option(StoreLimits.bytes, "the JSON those stored responses may hold in all, e.g. "
                                        "64MiB", parse=parse_bytes, metavar="SIZE", shown="64MiB")
    responses_store_seconds: float = option(StoreLimits.seconds, "how long a stored response is kept")

    def __post_init__(self) -> None:
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ConfigError(f"default_max_tokens must be at least 1, got {self.default_max_tokens}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port must be between 0 and 65535, got {self.port}")
        if self.max_queue < 1:
            raise ConfigError(f"max_queue must be at least 1, got {self.max_queue}")
        if self.grace_period < 0:
            raise ConfigError(f"grace_period must be at least 0 seconds, got {self.grace_period}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("api_key must not be empty; leave it unset to disable authentication")
        check_speculate_quadrants(self.speculate_quadrants)
        try:
            StreamInterval.parse(self.stream_interval)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ConfigError("served_model_name must not be blank")
        for name in ("responses_store_entries", "responses_store_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.responses_store_seconds > 0:
            raise ConfigError(f"responses_store_seconds must be positive, got {self.responses_store_seconds}")

    def store_limits(self) -> StoreLimits:
        """The bounds of the responses /v1/responses keeps."""
        return StoreLimits(self.responses_store_entries, self.responses_store_bytes, self.responses_store_seconds)


@dataclass(frozen=True)
class ActorOptions:
    """How `serve` runs the engine: actor processes and their placement, or one in-process engine."""

    decode_actors: int = option(1, "decode actor processes (each also prefills colocated requests in chunks)")
    prefill_actors: int = option(0, "prefill actor processes (0: every request is colocated)")
    draft_actors: int = option(0, "with --speculative draft: draft model processes serving the decode actors "
                               "(0: the draft runs inside each decode actor)")
    devices: tuple[str, ...] = option((), "comma-separated devices for the actors, e.g. cuda:0,cuda:1, prefill "
                                      "actors first", parse=parse_list, shown="CPU, cores split between actors")
    disagg: DisaggMode = option("auto", "disaggregate a request (prefill actor + KV hand-off) when the cost model "
                                "says it pays (auto), always, or never")
    listen_workers: str | None = option(None, "accept `cli.py worker --connect` actors from other hosts (secret: "
                                        "$PHASE_SERVE_SECRET)", metavar="HOST:PORT", shown="none")
    capacity_timeout: float = option(30.0, "seconds a request waits for a decode actor to come (back) up, e.g. "
                                     "during a restart, before it gets 503 with Retry-After")
    max_migrations: int = option(3, "times one stream may move to another decode actor (its own died or "
                                 "drained) before it ends with an error; 0: a stream on a dead actor ends at once")
    actor_start_silence: float = option(DEFAULT_START_SILENCE, "seconds a starting actor may go without reporting "
                                        "progress (loading weights, building kernels, calibrating) before it is "
                                        "given up; its start as a whole has no time limit")
    ray: str | None = option(None, "place the actors on a Ray cluster: auto (the running one), local (a private "
                             "one on this host, on 127.0.0.1) or HOST:PORT of its head", metavar="auto|local|HOST:PORT",
                             shown="none: actor subprocesses on this host")
    ray_cpus: float = option(1.0, "with --ray: the CPUs each CPU actor reserves (a cuda device reserves one GPU)")
    ray_prefill_resources: str | None = option(
        None, "with --ray: custom Ray resources every prefill actor reserves, as JSON, e.g. '{\"compute_node\": 1}' "
        "(a node label: compute-rich nodes)", metavar="JSON", shown="none")
    ray_decode_resources: str | None = option(
        None, "with --ray: custom Ray resources every decode actor reserves, as JSON, e.g. '{\"decode_node\": 1}' "
        "(bandwidth-rich nodes)", metavar="JSON", shown="none")
    ray_connect_timeout: float = option(RayOptions.connect_timeout, "with --ray: seconds to reach the cluster before "
                                        "serve refuses to start")
    ray_placement_timeout: float = option(RayOptions.placement_timeout, "with --ray: seconds the cluster gets to "
                                          "place every actor before serve refuses to start")
    in_process: bool = option(False, "run the engine inside the server process instead of actor subprocesses "
                              "(debugging)")
    long_prompt_threshold: int | None = option(None, "prompt tokens from which a request is long-in",
                                               shown="context / 16, at least 64")
    long_output_threshold: int | None = option(None, "max_tokens from which a request is long-out",
                                               shown="context / 32, at least 64")

    def __post_init__(self) -> None:
        if self.capacity_timeout <= 0:
            raise ConfigError(f"capacity_timeout must be positive, got {self.capacity_timeout}")
        if self.max_migrations < 0:
            raise ConfigError(f"max_migrations must not be negative, got {self.max_migrations}")
        if not self.actor_start_silence > 0:
            raise ConfigError(f"actor_start_silence must be positive, got {self.actor_start_silence}")
        self.ray_options()  # ConfigError for a bad --ray value or resource JSON

    def ray_options(self) -> RayOptions | None:
        if self.ray is None:
            return None
        return RayOptions(self.ray, self.ray_cpus, parse_resources(self.ray_prefill_resources or "{}"),
                          parse_resources(self.ray_decode_resources or "{}"),
                          connect_timeout=self.ray_connect_timeout, placement_timeout=self.ray_placement_timeout)

    def client_options(self) -> dict:
        """The AsyncLLM keyword arguments (none in process)."""
        if self.in_process:
            return {}
        return dict(decode_actors=self.decode_actors, prefill_actors=self.prefill_actors, devices=self.devices,
                    disagg=self.disagg, listen_workers=self.listen_workers, draft_actors=self.draft_actors,
                    capacity_timeout=self.capacity_timeout, max_migrations=self.max_migrations, ray=self.ray_options(),
                    start_silence=self.actor_start_silence)

    def thresholds(self, context: int) -> QuadrantThresholds:
        """Thresholds as given, else scaled to the served model's context (8192 -> 512 in, 256 out)."""
        return QuadrantThresholds(self.long_prompt_threshold or max(64, context // 16),
                                  self.long_output_threshold or max(64, context // 32))
