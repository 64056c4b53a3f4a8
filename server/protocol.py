"""OpenAI request bodies -> typed, validated requests and SamplingParams. Nothing invalid gets past here.

Parsing happens in two steps: `parse_completion` / `parse_chat` check the body's shape and types; once the
prompt is tokenised, `sampling_params` checks it against the model's context and builds SamplingParams.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from engine.sampling.sampling_params import SamplingParams, SamplingParamsError
from engine.sampling.structured import Guide, GuideError
from frontend.tools import Tool, ToolChoice, ToolError, parse_tool_choice, parse_tools
from server.errors import ApiError, bad_request, invalid_type, json_type
from server.request_fields import CHAT, COMPLETIONS, refuse_unsupported

INT64_MIN, UINT64_MAX = -(1 << 63), (1 << 64) - 1
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP_SEQUENCES = 16


@dataclass(frozen=True)
class ModelLimits:
    name: str  # the name clients must send as `model`
    max_model_len: int
    vocab_size: int


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    tool_calls: tuple[dict[str, Any], ...] = ()  # an assistant's calls, OpenAI's shape
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None


@dataclass(frozen=True)
class RequestDefaults:
    """What a request that leaves a field out gets: the model's generation_config.json where it says, else
    OpenAI's defaults; max_tokens from --default-max-tokens (completions: else OpenAI's 16; chat: else the
    rest of the context)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None


@dataclass(frozen=True)
class SamplingFields:
    """The sampling fields of a request, type-checked; ranges are checked by SamplingParams."""

    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"  # which field set it, for error messages
    max_tokens_defaulted: bool = False  # not in the request: capped at the room the prompt leaves
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # top alternatives per token; None = no logprobs
    logprobs_param: str = "logprobs"
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    guide: Guide | None = None  # structured outputs
    guide_param: str = "response_format"  # the field that set it, for error messages
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True


@dataclass(frozen=True)
class GenerationRequest:
    """A parsed /v1/completions or /v1/chat/completions body. `prompt` is text or token ids for completions,
    messages for chat."""

    prompt: str | tuple[int, ...] | tuple[Message, ...]
    sampling: SamplingFields
    chat: bool = False
    stream: bool = False
    include_usage: bool = False
    priority: int = 0
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = field(default_factory=lambda: ToolChoice("none"))
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None  # more samples than n, the best n returned
    prompts: tuple[str | tuple[int, ...], ...] = ()  # a completion's list of several prompts, in order

    @property
    def prompt_param(self) -> str:
        return "messages" if self.chat else "prompt"

    def per_prompt(self) -> list[GenerationRequest]:
        """One request per prompt of a list (each runs as its own engine request); [self] for one prompt."""
        if not self.prompts:
            return [self]
        return [replace(self, prompt=p, prompts=()) for p in self.prompts]

    def echo_text(self, tokenizer: Any) -> str | None:
        """With echo: the prompt as text, which the completion's text follows."""
        if not self.echo or self.chat:
            return None
        if isinstance(self.prompt, str):
            return self.prompt
        return tokenizer.decode(list(self.prompt), skip_special_tokens=False)


# ---------------------------------------------------------------------------------------- body and types

def parse_json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {json_type(body)}.", None, "invalid_json")
    return body


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _typed(body: dict[str, Any], name: str, accept: Callable[[Any], bool], expected: str, default: Any) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if not accept(value):
        raise invalid_type(name, expected, value)
    return value


def _int(body: dict[str, Any], name: str, default: int | None = None) -> int | None:
    return _typed(body, name, _is_int, "an integer", default)


def _number(body: dict[str, Any], name: str, default: float) -> float:
    return float(_typed(body, name, _is_number, "a number", default))


def _bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    return _typed(body, name, lambda v: isinstance(v, bool), "a boolean", default)


def _object(body: dict[str, Any], name: str) -> dict[str, Any]:
    return _typed(body, name, lambda v: isinstance(v, dict), "an object", {})


# ---------------------------------------------------------------------------------------- sampling fields

def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid_type("stop", "a string or an array of strings", stop)
    if len(stops) > MAX_STOP_SEQUENCES:
        raise bad_request(f"'stop' may hold at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}.", "stop")
    return tuple(stops)


def _token_ids(body: dict[str, Any], name: str) -> tuple[int, ...]:
    ids = body.get(name)
    if ids is None:
        return ()
    if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
        raise invalid_type(name, "an array of integers", ids)
    return tuple(ids)


def _logit_bias(body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"token id": bias}` map (JSON keys are strings); ranges are checked by SamplingParams."""
    bias = _object(body, "logit_bias")
    pairs = []
    for key, value in bias.items():
        if not re.fullmatch(r"\s*-?[0-9]+\s*", key):
            raise bad_request(f"'logit_bias' keys must be token ids, got {key!r}.", "logit_bias")
        if not _is_number(value):
            raise invalid_type("logit_bias", "an object of token ids to numbers", value)
        pairs.append((int(key), float(value)))
    return tuple(pairs)


def _seed(body: dict[str, Any]) -> int | None:
    seed = _int(body, "seed")
    if seed is not None and not INT64_MIN <= seed <= UINT64_MAX:
        raise bad_request(f"'seed' must fit in 64 bits, got {seed}.", "seed")
    return seed


def _max_tokens(body: dict[str, Any], names: tuple[str, ...]) -> tuple[int | None, str]:
    for name in names:
        value = _int(body, name)
        if value is not None:
            return value, name
    return None, names[0]


def _repetition_penalty(body: dict[str, Any], default: float) -> float:
    """vLLM's repetition_penalty, or llama.cpp server's repeat_penalty (the same operation)."""
    if body.get("repetition_penalty") is not None and body.get("repeat_penalty") is not None:
        raise bad_request("'repetition_penalty' and 'repeat_penalty' are the same control; give one.",
                          "repeat_penalty")
    name = "repeat_penalty" if body.get("repeat_penalty") is not None else "repetition_penalty"
    return _number(body, name, default)


def _sampling_fields(body: dict[str, Any], max_token_names: tuple[str, ...], logprobs: tuple[int | None, str],
                     default_max_tokens: int | None, defaults: RequestDefaults) -> SamplingFields:
    max_tokens, max_param = _max_tokens(body, max_token_names + ("n_predict",))
    return SamplingFields(
        max_tokens=default_max_tokens if max_tokens is None else max_tokens, max_tokens_param=max_param,
        max_tokens_defaulted=max_tokens is None and default_max_tokens is not None,
        logprobs=logprobs[0], logprobs_param=logprobs[1],
        n=_int(body, "n", 1), temperature=_number(body, "temperature", defaults.temperature),
        top_p=_number(body, "top_p", defaults.top_p), top_k=_int(body, "top_k", defaults.top_k), seed=_seed(body),
        stop=_stop(body), stop_token_ids=_token_ids(body, "stop_token_ids"), ignore_eos=_bool(body, "ignore_eos"),
        min_tokens=_int(body, "min_tokens", 0), presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        repetition_penalty=_repetition_penalty(body, defaults.repetition_penalty),
        min_p=_number(body, "min_p", defaults.min_p), logit_bias=_logit_bias(body),
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output"),
        skip_special_tokens=_bool(body, "skip_special_tokens", True), **_guide_fields(body))


# ---------------------------------------------------------------------------------------- structured outputs

# The spellings of one constraint: OpenAI's response_format, vLLM's guided_* fields and their newer
# structured_outputs object, and llama.cpp server's json_schema and grammar. At most one may be given.
_GUIDE_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "structured_outputs", "json_schema", "grammar")


def _guide_fields(body: dict[str, Any]) -> dict[str, Any]:
    given = [(name, body[name]) for name in _GUIDE_FIELDS if body.get(name) is not None]
    guides = [(name, _guide(name, value)) for name, value in given]
    guides = [(name, g) for name, g in guides if g is not None]
    if len(guides) > 1:
        raise bad_request(f"'{guides[0][0]}' and '{guides[1][0]}' both constrain the output; give one.",
                          guides[1][0])
    return dict(guide=guides[0][1], guide_param=guides[0][0]) if guides else {}


def _guide(name: str, value: Any) -> Guide | None:
    try:
        if name == "response_format":
            return _response_format(value)
        if name == "structured_outputs":
            return _structured_outputs(value)
        if name in ("guided_json", "json_schema"):
            return Guide.json_schema(value)
        if name in ("guided_regex", "guided_grammar", "grammar"):
            if not isinstance(value, str) or not value:
                raise invalid_type(name, "a non-empty string", value)
            return Guide("regex" if name == "guided_regex" else "grammar", value)
        return _choice(name, value)
    except GuideError as exc:
        raise bad_request(f"'{name}': {exc}", name) from None


def _choice(name: str, value: Any) -> Guide:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise invalid_type(name, "a non-empty array of strings", value)
    return Guide("choice", choices=tuple(value))


def _response_format(value: Any) -> Guide | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise invalid_type("response_format", "an object with a 'type'", value)
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Guide("json_object")
    if kind != "json_schema":
        raise bad_request(f"'response_format.type' must be text, json_object or json_schema, got {kind!r}.",
                          "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or spec.get("schema") is None:
        raise bad_request("'response_format.json_schema.schema' is required for type json_schema.",
                          "response_format")
    return Guide.json_schema(spec["schema"])


def _structured_outputs(value: Any) -> Guide | None:
    if not isinstance(value, dict):
        raise invalid_type("structured_outputs", "an object", value)
    kinds = {"json": lambda v: Guide.json_schema(v), "regex": lambda v: Guide("regex", _text("regex", v)),
             "choice": lambda v: _choice("structured_outputs.choice", v),
             "grammar": lambda v: Guide("grammar", _text("grammar", v)),
             "json_object": lambda v: Guide("json_object") if v else None}
    unknown = sorted(set(value) - set(kinds))
    if unknown:
        raise bad_request(f"'structured_outputs' has no field {unknown[0]!r}; it takes one of "
                          f"{', '.join(kinds)}.", "structured_outputs")
    guides = [g for key, v in value.items() if v is not None and (g := kinds[key](v)) is not None]
    if len(guides) > 1:
        raise bad_request("'structured_outputs' holds more than one constraint; give one.", "structured_outputs")
    return guides[0] if guides else None


def _text(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise invalid_type(f"structured_outputs.{name}", "a non-empty string", value)
    return value


# ---------------------------------------------------------------------------------------- common envelope

def _check_model(body: dict[str, Any], served: str) -> None:
    check_model_name(_typed(body, "model", lambda v: isinstance(v, str), "a string", served), served)


def check_model_name(model: str, served: str) -> None:
    """404 model_not_found for any name but the served one, as OpenAI and vLLM answer."""
    if model != served:
        raise model_not_found(model, served)


def model_not_found(model: str, served: str) -> ApiError:
    return ApiError(404, f"the model '{model}' does not exist; this server serves '{served}'.", "model",
                    "model_not_found")


def _include_usage(body: dict[str, Any], stream: bool) -> bool:
    options = _object(body, "stream_options")
    if options and not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true.", "stream_options")
    value = options.get("include_usage", False)
    if not isinstance(value, bool):
        raise invalid_type("stream_options.include_usage", "a boolean", value)
    return value


def _envelope(body: dict[str, Any], served: str, route: str) -> dict[str, Any]:
    _check_model(body, served)
    refuse_unsupported(body, route)
    stream = _bool(body, "stream")
    return dict(stream=stream, include_usage=_include_usage(body, stream), priority=_int(body, "priority", 0))


# ---------------------------------------------------------------------------------------- completions

def parse_completion(body: dict[str, Any], served_model: str,
                     defaults: RequestDefaults = RequestDefaults()) -> GenerationRequest:
    envelope = _envelope(body, served_model, COMPLETIONS)
    logprobs = (_int(body, "logprobs"), "logprobs")
    fields = _sampling_fields(body, ("max_tokens",), logprobs, defaults.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS,
                              defaults)
    echo = _bool(body, "echo")
    if echo and fields.logprobs is not None:
        raise bad_request("'echo' with 'logprobs' would need the prompt's logprobs, which this server does not "
                          "compute; drop one of them.", "echo", "unsupported_parameter")
    suffix = _typed(body, "suffix", lambda v: isinstance(v, str), "a string", None) or None
    prompts = _completion_prompts(body.get("prompt"))
    return GenerationRequest(prompts[0], fields, chat=False, echo=echo, suffix=suffix,
                             best_of=_best_of(body, fields, envelope["stream"]),
                             prompts=prompts if len(prompts) > 1 else (), **envelope)


def _best_of(body: dict[str, Any], fields: SamplingFields, stream: bool) -> int | None:
    best_of = _int(body, "best_of")
    if best_of is None or best_of == fields.n:
        return None
    if best_of < fields.n:
        raise bad_request(f"'best_of' ({best_of}) must be at least 'n' ({fields.n}).", "best_of")
    if stream:
        raise bad_request("'best_of' cannot be streamed: the best samples are known only once all have finished.",
                          "best_of")
    return best_of


def _completion_prompts(prompt: Any) -> tuple[str | tuple[int, ...], ...]:
    """OpenAI's four shapes: a string, token ids, a list of strings, a list of token-id lists (or a mix of
    the last two); the prompts in order."""
    if prompt is None:
        raise bad_request("'prompt' is required.", "prompt", "missing_required_parameter")
    is_list = isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt)
    if not is_list:
        return (_one_prompt(prompt, "prompt"),)
    return tuple(_one_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt))


def _one_prompt(prompt: Any, where: str) -> str | tuple[int, ...]:
    if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        prompt = tuple(prompt)
    elif not isinstance(prompt, str):
        raise bad_request(f"'{where}' must be a string or an array of token ids, got {json_type(prompt)}.",
                          "prompt", "invalid_type")
    if not prompt:
        raise bad_request(f"'{where}' must not be empty.", "prompt")
    return prompt


# ---------------------------------------------------------------------------------------- chat

def parse_chat(body: dict[str, Any], served_model: str,
               defaults: RequestDefaults = RequestDefaults()) -> GenerationRequest:
    envelope = _envelope(body, served_model, CHAT)
    fields = _sampling_fields(body, ("max_completion_tokens", "max_tokens"), _chat_logprobs(body),
                              defaults.max_tokens, defaults)
    tools, choice = parse_tool_fields(body)
    if choice.forced and fields.guide is not None:
        raise bad_request(f"'tool_choice' {choice.mode} and '{fields.guide_param}' both constrain the output; "
                          f"give one.", "tool_choice")
    return GenerationRequest(parse_messages(body.get("messages")), fields, chat=True, tools=tools,
                             tool_choice=choice,
                             parallel_tool_calls=_bool(body, "parallel_tool_calls", True),
                             add_generation_prompt=_bool(body, "add_generation_prompt", True), **envelope)


def parse_tool_fields(body: dict[str, Any]) -> tuple[tuple[Tool, ...], ToolChoice]:
    try:
        tools = parse_tools(body.get("tools"))
        return tools, parse_tool_choice(body.get("tool_choice"), tools)
    except ToolError as exc:
        raise bad_request(str(exc), exc.param) from None


def _chat_logprobs(body: dict[str, Any]) -> tuple[int | None, str]:
    wanted = _bool(body, "logprobs")
    top = _int(body, "top_logprobs")
    if top is not None and not wanted:
        raise bad_request("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs")
    return ((top or 0) if wanted else None), "top_logprobs"


def parse_messages(messages: Any) -> tuple[Message, ...]:
    if messages is None:
        raise bad_request("'messages' is required.", "messages", "missing_required_parameter")
    if not isinstance(messages, list):
        raise invalid_type("messages", "an array of messages", messages)
    if not messages:
        raise bad_request("'messages' must hold at least one message.", "messages")
    return tuple(_message(m, f"messages[{i}]") for i, m in enumerate(messages))


def _message(item: Any, where: str) -> Message:
    if not isinstance(item, dict):
        raise invalid_type(where, "an object with 'role' and 'content'", item)
    role = item.get("role")
    if role not in CHAT_ROLES:
        raise bad_request(f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}, got {role!r}.", f"{where}.role")
    calls = _message_tool_calls(item.get("tool_calls"), f"{where}.tool_calls") if role == "assistant" else ()
    content = "" if calls and item.get("content") is None else _content(item.get("content"), f"{where}.content", role)
    call_id = _typed(item, "tool_call_id", lambda v: isinstance(v, str), "a string", None)
    if role == "tool" and call_id is None:
        raise bad_request(f"'{where}.tool_call_id' is required in a tool message: it names the call answered.",
                          f"{where}.tool_call_id", "missing_required_parameter")
    name = _typed(item, "name", lambda v: isinstance(v, str), "a string", None)
    return Message(role, content, calls, call_id, name)


def _message_tool_calls(calls: Any, where: str) -> tuple[dict[str, Any], ...]:
    """An assistant message's earlier calls: `[{"id", "type": "function", "function": {"name", "arguments"}}]`,
    the arguments a JSON object as text."""
    if calls is None:
        return ()
    if not isinstance(calls, list):
        raise invalid_type(where, "an array of tool calls", calls)
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"'{where}[{i}]' must be {{\"id\", \"type\": \"function\", \"function\": "
                              f"{{\"name\", \"arguments\"}}}}.", f"{where}[{i}]")
        args = fn.get("arguments", "{}")
        try:
            parsed = json.loads(args) if isinstance(args, str) else None
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise bad_request(f"'{where}[{i}].function.arguments' must be a JSON object as a string.",
                              f"{where}[{i}].function.arguments")
        out.append({"id": str(call.get("id") or f"call_{i}"), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return tuple(out)


def _content(content: Any, where: str, role: str) -> str:
    if content is None and role == "assistant":
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(_is_text_part(p) for p in content):
        return "".join(p["text"] for p in content)
    raise invalid_type(where, "a string or an array of text parts", content)


def _is_text_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)


def messages_as_dicts(messages: tuple[Message, ...]) -> list[dict[str, Any]]:
    """The messages as chat templates take them (Hugging Face's shape)."""
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            d["tool_calls"] = [dict(c) for c in m.tool_calls]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


# ---------------------------------------------------------------------------------------- against the model

def check_prompt_tokens(token_ids: list[int], limits: ModelLimits, param: str) -> None:
    """The tokenised prompt must be non-empty, inside the vocabulary and leave room for one output token."""
    if not token_ids:
        raise bad_request(f"'{param}' is empty once tokenised.", param)
    _check_vocab(token_ids, limits, param)
    if len(token_ids) >= limits.max_model_len:
        raise bad_request(f"this model's maximum context length is {limits.max_model_len} tokens, and the "
                          f"{param} hold {len(token_ids)} tokens, leaving no room for output.", param,
                          "context_length_exceeded")


def _check_vocab(token_ids: Sequence[int], limits: ModelLimits, param: str) -> None:
    bad = next((t for t in token_ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise bad_request(f"'{param}' holds token id {bad}, outside this model's vocabulary of "
                          f"{limits.vocab_size}.", param)


def effective_max_tokens(fields: SamplingFields, prompt_tokens: int, limits: ModelLimits) -> int:
    room = limits.max_model_len - prompt_tokens
    return room if fields.max_tokens is None else fields.max_tokens


def sampling_params(fields: SamplingFields, prompt_tokens: int, limits: ModelLimits) -> SamplingParams:
    """SamplingParams for a prompt of `prompt_tokens` tokens; 400 naming the field when anything is off."""
    if fields.max_tokens_defaulted and fields.max_tokens is not None:
        fields = replace(fields, max_tokens=max(1, min(fields.max_tokens, limits.max_model_len - prompt_tokens)))
    params = _build_params(fields)
    _check_vocab(fields.stop_token_ids, limits, "stop_token_ids")
    _check_vocab([t for t, _ in params.logit_bias], limits, "logit_bias")
    if fields.max_tokens is not None and prompt_tokens + fields.max_tokens > limits.max_model_len:
        raise bad_request(f"this model's maximum context length is {limits.max_model_len} tokens; you asked for "
                          f"{prompt_tokens + fields.max_tokens} ({prompt_tokens} in the prompt, {fields.max_tokens} "
                          f"in '{fields.max_tokens_param}').", fields.max_tokens_param, "context_length_exceeded")
    return params


def _build_params(fields: SamplingFields) -> SamplingParams:
    try:
        return SamplingParams(n=fields.n, max_tokens=fields.max_tokens, min_tokens=fields.min_tokens,
                              temperature=fields.temperature, top_p=fields.top_p, top_k=fields.top_k,
                              seed=fields.seed, stop=fields.stop, stop_token_ids=fields.stop_token_ids,
                              ignore_eos=fields.ignore_eos, logprobs=fields.logprobs,
                              presence_penalty=fields.presence_penalty, frequency_penalty=fields.frequency_penalty,
                              repetition_penalty=fields.repetition_penalty, min_p=fields.min_p,
                              logit_bias=fields.logit_bias, guide=fields.guide,
                              include_stop_str_in_output=fields.include_stop_str_in_output,
                              skip_special_tokens=fields.skip_special_tokens)
    except SamplingParamsError as exc:
        renamed = {"max_tokens": fields.max_tokens_param, "logprobs": fields.logprobs_param}
        param = renamed.get(exc.param, exc.param)
        raise ApiError(400, str(exc).replace(exc.param, param, 1), param, "invalid_value") from None
