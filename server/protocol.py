"""OpenAI request bodies -> typed, validated requests and SamplingParams. Nothing invalid gets past here.

Parsing happens in two steps: `parse_completion` / `parse_chat` check the body's shape and types and build
its SamplingParams (the request fields that set each SamplingParams field come from that field's declaration);
once the prompt is tokenised, `sampling_params` checks them against the model's context.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from engine.sampling.fields import ApiName, Endpoint, Shape, declared
from engine.sampling.sampling_params import SamplingParams, SamplingParamsError
from engine.sampling.structured import Guide, GuideError
from frontend.chat import check_template_kwargs
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


def _request_defaults_class() -> type:
    """RequestDefaults: a field per SamplingParams field that generation_config.json may set, plus max_tokens."""
    fields = [(f.name, f.type, field(default=f.default)) for f, spec in declared(SamplingParams)
              if spec.generation_config]
    return dataclasses.make_dataclass("RequestDefaults", [*fields, ("max_tokens", "int | None", field(default=None))],
                                      frozen=True, namespace={"__module__": __name__, "__doc__": _DEFAULTS_DOC})


_DEFAULTS_DOC = """What a request that leaves a field out gets: the model's generation_config.json where it says, else
SamplingParams' defaults; max_tokens from --default-max-tokens (completions: else OpenAI's 16; chat: else the rest
of the context)."""
RequestDefaults = _request_defaults_class()


@dataclass(frozen=True)
class SamplingFields:
    """A request's SamplingParams (validated), and which request field set each of its fields."""

    params: SamplingParams = SamplingParams()
    names: tuple[tuple[str, str], ...] = ()  # (SamplingParams field, the request field that set it), for errors
    max_tokens_capped: bool = False  # at most the room the prompt leaves: left out, or a Messages ceiling

    def param(self, name: str) -> str:
        """The request field that set the SamplingParams field `name` (`name` itself when none did)."""
        return dict(self.names).get(name, name)

    @property
    def guide_param(self) -> str:
        return self.param("guide")


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
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs, enable_thinking
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None  # more samples than n, the best n returned
    prompts: tuple[str | tuple[int, ...], ...] = ()  # a completion's list of several prompts, in order
    prompt_logprobs: int | None = None  # vLLM's field as given (the engine may compute more, for echo)
    thinking_budget: int | None = None  # the most thinking tokens (Anthropic's thinking.budget_tokens)

    @property
    def prompt_param(self) -> str:
        return "messages" if self.chat else "prompt"

    def per_prompt(self) -> list[GenerationRequest]:
        """One request per prompt of a list (each runs as its own engine request); [self] for one prompt."""
        if not self.prompts:
            return [self]
        return [replace(self, prompt=p, prompts=()) for p in self.prompts]

    @property
    def echo_logprobs(self) -> int | None:
        """With echo and logprobs: the alternatives each echoed prompt token shows."""
        return self.sampling.params.logprobs if self.echo and not self.chat else None

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


def _number(body: dict[str, Any], name: str, default: float | None = None) -> float | None:
    value = _typed(body, name, _is_number, "a number", default)
    return None if value is None else float(value)


def _bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    return _typed(body, name, lambda v: isinstance(v, bool), "a boolean", default)


def _object(body: dict[str, Any], name: str) -> dict[str, Any]:
    return _typed(body, name, lambda v: isinstance(v, dict), "an object", {})


# ---------------------------------------------------------------------------------------- sampling fields

def _stop(body: dict[str, Any], name: str) -> tuple[str, ...]:
    stop = body[name]
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid_type(name, "a string or an array of strings", stop)
    if len(stops) > MAX_STOP_SEQUENCES:
        raise bad_request(f"'{name}' may hold at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}.", name)
    return tuple(stops)


def _token_ids(body: dict[str, Any], name: str) -> tuple[int, ...]:
    ids = body[name]
    if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
        raise invalid_type(name, "an array of integers", ids)
    return tuple(ids)


def _logit_bias(body: dict[str, Any], name: str) -> tuple[tuple[int, float], ...]:
    """OpenAI's `{"token id": bias}` map (JSON keys are strings); ranges are checked by SamplingParams."""
    bias = _object(body, name)
    pairs = []
    for key, value in bias.items():
        if not re.fullmatch(r"\s*-?[0-9]+\s*", key):
            raise bad_request(f"'{name}' keys must be token ids, got {key!r}.", name)
        if not _is_number(value):
            raise invalid_type(name, "an object of token ids to numbers", value)
        pairs.append((int(key), float(value)))
    return tuple(pairs)


def _seed(body: dict[str, Any], name: str) -> int:
    seed = _int(body, name)
    if not INT64_MIN <= seed <= UINT64_MAX:
        raise bad_request(f"'{name}' must fit in 64 bits, got {seed}.", name)
    return seed


_READERS: dict[Shape, Callable[[dict[str, Any], str], Any]] = {
    Shape.INTEGER: _int, Shape.NUMBER: _number, Shape.BOOLEAN: _bool, Shape.STRINGS: _stop,
    Shape.TOKEN_IDS: _token_ids, Shape.TOKEN_BIAS: _logit_bias, Shape.SEED: _seed,
}


def _logprobs(body: dict[str, Any], names: tuple[ApiName, ...]) -> tuple[int | None, str]:
    """Completions: one integer. Chat: a boolean, and the integer in a second field that needs it true."""
    if len(names) == 1:
        return _int(body, names[0].name), names[0].name
    flag, top_name = names[0].name, names[1].name
    wanted = _bool(body, flag)
    top = _int(body, top_name)
    if top is not None and not wanted:
        raise bad_request(f"'{top_name}' requires '{flag}' to be true.", top_name)
    return ((top or 0) if wanted else None), top_name


def _given(body: dict[str, Any], names: tuple[ApiName, ...], shape: Shape) -> tuple[Any, str] | None:
    """(the value, the request field that gave it), None when the request gives none of `names`: the first
    one given wins, and one declared exclusive may not come with another."""
    if shape is Shape.LOGPROBS:
        return _logprobs(body, names)
    given = [n for n in names if body.get(n.name) is not None]
    if len(given) > 1 and any(n.exclusive for n in given):
        raise bad_request(f"'{given[0].name}' and '{given[1].name}' are the same control; give one.",
                          given[1].name)
    if not given:
        return None
    return _READERS[shape](body, given[0].name), given[0].name


def _sampling_fields(body: dict[str, Any], endpoint: Endpoint, default_max_tokens: int | None,
                     defaults: RequestDefaults) -> SamplingFields:
    """Each SamplingParams field a request field on `endpoint` sets, else its default (`defaults`, then
    SamplingParams'); max_tokens left out is `default_max_tokens`."""
    values: dict[str, Any] = {"max_tokens": default_max_tokens}
    set_by: dict[str, str] = {}
    for f, spec in declared(SamplingParams):
        names = spec.names_on(endpoint)
        found = _given(body, names, spec.shape) if names else None
        if found is not None:
            values[f.name], set_by[f.name] = found
        elif spec.generation_config:
            values[f.name] = getattr(defaults, f.name)
    guide = _guide_fields(body)
    if guide is not None:
        values["guide"], set_by["guide"] = guide
    fields = SamplingFields(names=tuple(set_by.items()),
                            max_tokens_capped="max_tokens" not in set_by and default_max_tokens is not None)
    return replace(fields, params=_checked(fields, lambda: SamplingParams(**values)))


def _checked(fields: SamplingFields, build: Callable[[], SamplingParams]) -> SamplingParams:
    """build(), its SamplingParamsError as a 400 naming the request field that set the bad value."""
    try:
        return build()
    except SamplingParamsError as exc:
        param = fields.param(exc.param)
        raise ApiError(400, str(exc).replace(exc.param, param, 1), param, "invalid_value") from None


# ---------------------------------------------------------------------------------------- structured outputs

# The spellings of one constraint: OpenAI's response_format, vLLM's guided_* fields and their newer
# structured_outputs object, and llama.cpp server's json_schema and grammar. At most one may be given.
_GUIDE_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                 "structured_outputs", "json_schema", "grammar")


def _guide_fields(body: dict[str, Any]) -> tuple[Guide, str] | None:
    """(the constraint, the request field that gave it), None when there is none."""
    given = [(name, body[name]) for name in _GUIDE_FIELDS if body.get(name) is not None]
    guides = [(name, _guide(name, value)) for name, value in given]
    guides = [(name, g) for name, g in guides if g is not None]
    if len(guides) > 1:
        raise bad_request(f"'{guides[0][0]}' and '{guides[1][0]}' both constrain the output; give one.",
                          guides[1][0])
    return (guides[0][1], guides[0][0]) if guides else None


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
    fields = _sampling_fields(body, COMPLETIONS, defaults.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS, defaults)
    echo = _bool(body, "echo")
    wanted = _prompt_logprobs(fields, envelope["stream"])
    if echo and fields.params.logprobs is not None:  # the echoed prompt's tokens come with their logprobs
        top = max(fields.params.logprobs, wanted or 0)
        fields = replace(fields, params=_checked(fields, lambda: replace(fields.params, prompt_logprobs=top)))
    suffix = _typed(body, "suffix", lambda v: isinstance(v, str), "a string", None) or None
    prompts = _completion_prompts(body.get("prompt"))
    return GenerationRequest(prompts[0], fields, chat=False, echo=echo, suffix=suffix,
                             best_of=_best_of(body, fields, envelope["stream"]),
                             prompts=prompts if len(prompts) > 1 else (), prompt_logprobs=wanted, **envelope)


def _prompt_logprobs(fields: SamplingFields, stream: bool) -> int | None:
    """vLLM's prompt_logprobs as the request gives it; not with stream, as vLLM refuses the pair too."""
    wanted = fields.params.prompt_logprobs
    if wanted is not None and stream:
        raise bad_request("'prompt_logprobs' come with the whole response only; they are not available when "
                          "'stream' is true.", "prompt_logprobs", "unsupported_parameter")
    return wanted


def _best_of(body: dict[str, Any], fields: SamplingFields, stream: bool) -> int | None:
    best_of = _int(body, "best_of")
    n = fields.params.n
    if best_of is None or best_of == n:
        return None
    if best_of < n:
        raise bad_request(f"'best_of' ({best_of}) must be at least 'n' ({n}).", "best_of")
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
    fields = _sampling_fields(body, CHAT, defaults.max_tokens, defaults)
    tools, choice = parse_tool_fields(body)
    if choice.forced and fields.params.guide is not None:
        raise bad_request(f"'tool_choice' {choice.mode} and '{fields.guide_param}' both constrain the output; "
                          f"give one.", "tool_choice")
    return GenerationRequest(parse_messages(body.get("messages")), fields, chat=True, tools=tools,
                             tool_choice=choice, prompt_logprobs=_prompt_logprobs(fields, envelope["stream"]),
                             parallel_tool_calls=_bool(body, "parallel_tool_calls", True),
                             add_generation_prompt=_bool(body, "add_generation_prompt", True),
                             template_kwargs=parse_template_kwargs(body), **envelope)


def parse_template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """`chat_template_kwargs` (variables for the chat template), with `enable_thinking` given on its own as a
    shorthand for the variable of that name."""
    kwargs = _object(body, "chat_template_kwargs")
    try:
        check_template_kwargs(kwargs)
    except ValueError as exc:
        raise bad_request(f"'chat_template_kwargs': {exc}.", "chat_template_kwargs") from None
    thinking = body.get("enable_thinking")
    if thinking is None:
        return kwargs
    _bool(body, "enable_thinking")
    if kwargs.get("enable_thinking", thinking) != thinking:
        raise bad_request("'enable_thinking' and 'chat_template_kwargs.enable_thinking' disagree; give one.",
                          "enable_thinking")
    return {**kwargs, "enable_thinking": thinking}


def parse_tool_fields(body: dict[str, Any]) -> tuple[tuple[Tool, ...], ToolChoice]:
    try:
        tools = parse_tools(body.get("tools"))
        return tools, parse_tool_choice(body.get("tool_choice"), tools)
    except ToolError as exc:
        raise bad_request(str(exc), exc.param) from None


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
    return room if fields.params.max_tokens is None else fields.params.max_tokens


def sampling_params(fields: SamplingFields, prompt_tokens: int, limits: ModelLimits) -> SamplingParams:
    """SamplingParams for a prompt of `prompt_tokens` tokens; 400 naming the field when anything is off."""
    params = fields.params
    if fields.max_tokens_capped and params.max_tokens is not None:
        room = limits.max_model_len - prompt_tokens
        params = _checked(fields, lambda: replace(params, max_tokens=max(1, min(params.max_tokens, room))))
    _check_vocab(params.stop_token_ids, limits, "stop_token_ids")
    _check_vocab([t for t, _ in params.logit_bias], limits, "logit_bias")
    if params.max_tokens is not None and prompt_tokens + params.max_tokens > limits.max_model_len:
        param = fields.param("max_tokens")
        raise bad_request(f"this model's maximum context length is {limits.max_model_len} tokens; you asked for "
                          f"{prompt_tokens + params.max_tokens} ({prompt_tokens} in the prompt, {params.max_tokens} "
                          f"in '{param}').", param, "context_length_exceeded")
    return params
