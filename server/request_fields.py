"""Every request field this server knows, with its fate: implemented, refused (400 naming it) or ignored
(it cannot change the output). A field that would change the output is never silently ignored; fields in
no table here are ignored, as OpenAI-compatible servers do. The rows of the fields that set SamplingParams
fields come from those fields' declarations (engine/sampling/fields.py).

`tests/test_request_fields.py` walks REQUEST_FIELDS: each refused field, sent with its `example`, gets a 400
whose `param` names it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from engine.sampling.fields import BOTH, Endpoint, declared
from engine.sampling.sampling_params import SamplingParams
from server.errors import bad_request

COMPLETIONS, CHAT = Endpoint.COMPLETIONS, Endpoint.CHAT
IMPLEMENTED, REFUSED, IGNORED = "implemented", "refused", "ignored"


def _given(value: Any) -> bool:
    return value is not None and value != [] and value != {}


def _other_than(*defaults: Any) -> Callable[[Any], bool]:
    return lambda value: value is not None and value not in defaults


@dataclass(frozen=True)
class Fate:
    fate: str  # IMPLEMENTED, REFUSED or IGNORED
    why: str  # what it does, or why it is refused or ignored
    routes: tuple[Endpoint, ...] = BOTH
    refused_if: Callable[[Any], bool] = _given  # REFUSED: the values refused (the defaults pass)
    example: Any = True  # REFUSED: a value that is refused


def _impl(why: str, routes: tuple[Endpoint, ...] = BOTH) -> Fate:
    return Fate(IMPLEMENTED, why, routes)


def _refuse(why: str, refused_if: Callable[[Any], bool] = _given, example: Any = True,
            routes: tuple[Endpoint, ...] = BOTH) -> Fate:
    return Fate(REFUSED, why, routes, refused_if, example)


def _ignore(why: str, routes: tuple[Endpoint, ...] = BOTH) -> Fate:
    return Fate(IGNORED, why, routes)


def _joined(*tables: dict[str, Fate]) -> dict[str, Fate]:
    """The tables as one; a field in two of them is a ValueError (each field has one fate, declared once)."""
    joined: dict[str, Fate] = {}
    for table in tables:
        repeated = sorted(joined.keys() & table.keys())
        if repeated:
            raise ValueError(f"request fields declared twice: {', '.join(repeated)}")
        joined |= table
    return joined


def _sampling_rows() -> dict[str, Fate]:
    """The request fields that set SamplingParams fields, from those fields' declarations."""
    return _joined(*({name.name: _impl(name.why, name.endpoints)} for _, spec in declared(SamplingParams)
                     for name in spec.names))


REQUEST_FIELDS: dict[str, Fate] = _joined(_sampling_rows(), {
    # envelope
    "model": _impl("must name the served model"),
    "prompt": _impl("text, token ids, or a batch of one", (COMPLETIONS,)),
    "messages": _impl("system, developer, user, assistant (with tool_calls) and tool messages", (CHAT,)),
    "stream": _impl("server-sent events ending in [DONE]"),
    "stream_options": _impl("include_usage"),
    "priority": _impl("scheduling priority (lower runs first)"),
    # the sampling fields come first, from _sampling_rows()
    "best_of": _impl("samples generated, of which the n with the highest cumulative logprob are returned; "
                     "not with stream", (COMPLETIONS,)),
    # structured outputs and tools
    "response_format": _impl("text, json_object or json_schema"),
    "guided_json": _impl("vLLM: a JSON schema"),
    "guided_regex": _impl("vLLM: a regular expression"),
    "guided_choice": _impl("vLLM: one of these strings"),
    "guided_grammar": _impl("vLLM: an EBNF grammar"),
    "structured_outputs": _impl("vLLM's newer spelling of the guided_* fields"),
    "json_schema": _impl("llama.cpp server: a JSON schema"),
    "grammar": _impl("llama.cpp server: an EBNF grammar (xgrammar's dialect of GBNF)"),
    "tools": _impl("functions the model may call, rendered through the chat template", (CHAT,)),
    "tool_choice": _impl("auto, none, required or a named function (the last two grammar-enforced)", (CHAT,)),
    "parallel_tool_calls": _impl("false: at most one call", (CHAT,)),
    "add_generation_prompt": _impl("end the rendered chat with the assistant's turn opening", (CHAT,)),
    "chat_template_kwargs": _impl("extra variables for the model's chat template (enable_thinking, ...)",
                                  (CHAT,)),
    "enable_thinking": _impl("the chat template's enable_thinking variable (Qwen3: false writes an empty think "
                             "block into the prompt)", (CHAT,)),
    # completions extras
    "echo": _impl("the prompt's text before the completion; with logprobs, the prompt's tokens and their "
                  "logprobs before the completion's (the first token's null)", (COMPLETIONS,)),
    "suffix": _impl("fill-in-the-middle where the vocabulary has FIM tokens, else a 400", (COMPLETIONS,)),
    # refused: they would change the output in ways this server does not implement
    "typical_p": _refuse("locally typical sampling is not implemented", _other_than(1, 1.0), 0.5),
    "bad_words": _refuse("banned word sequences are not implemented; logit_bias bans single tokens",
                         example=["bad"]),
    "allowed_token_ids": _refuse("not implemented; a guided_choice or grammar constrains the output",
                                 example=[1, 2]),
    "use_beam_search": _refuse("beam search is not implemented", _other_than(False)),
    "length_penalty": _refuse("only acts with beam search, which is not implemented", _other_than(1, 1.0), 0.5),
    "early_stopping": _refuse("only acts with beam search, which is not implemented", _other_than(False)),
    "functions": _refuse("the legacy function-calling API; send tools instead", example=[{"name": "f"}]),
    "function_call": _refuse("the legacy function-calling API; send tool_choice instead",
                             _other_than("none"), "auto"),
    "mirostat": _refuse("mirostat sampling is not implemented", _other_than(0), 2),
    "tfs_z": _refuse("tail-free sampling is not implemented", _other_than(1, 1.0), 0.9),
    "dry_multiplier": _refuse("DRY repetition penalty is not implemented", _other_than(0, 0.0), 0.8),
    "xtc_probability": _refuse("XTC sampling is not implemented", _other_than(0, 0.0), 0.5),
    "dynatemp_range": _refuse("dynamic temperature is not implemented", _other_than(0, 0.0), 0.5),
    "penalty_last_n": _refuse("penalties always cover the whole sequence (-1)", _other_than(-1), 64),
    "samplers": _refuse("the sampler order is fixed", example=["top_k"]),
    "n_probs": _refuse("llama.cpp server's probabilities; send logprobs instead", _other_than(0), 5),
    "logits_processors": _refuse("custom logits processors are not loaded", example=["x"]),
    "guided_whitespace_pattern": _refuse("the whitespace of JSON constraints is fixed", example=r"[ ]?"),
    "return_tokens_as_token_ids": _refuse("tokens are returned as text", _other_than(False)),
    "spaces_between_special_tokens": _refuse("special tokens are detokenised without added spaces",
                                             _other_than(True), False),
    "add_special_tokens": _refuse("prompts are tokenised as the route defines (completions add BOS, chat "
                                  "leaves it to the template)", example=False),
    "echo@chat": _refuse("vLLM's chat echo of the last message is not implemented", _other_than(False),
                         routes=(CHAT,)),
    "continue_final_message": _refuse("the chat template always opens a new turn", _other_than(False),
                                      routes=(CHAT,)),
    "chat_template": _refuse("the model's own chat template is always used", example="{{ messages }}",
                             routes=(CHAT,)),
    "documents": _refuse("retrieval documents are not rendered", example=[{"text": "x"}], routes=(CHAT,)),
    "modalities": _refuse("only text is generated", lambda v: v is not None and v != ["text"], ["audio"],
                          (CHAT,)),
    "audio": _refuse("only text is generated", example={"voice": "alloy"}, routes=(CHAT,)),
    "reasoning_effort": _refuse("efforts are not mapped to thinking budgets (enable_thinking turns thinking off "
                                "where the chat template takes it)", example="low", routes=(CHAT,)),
    "web_search_options": _refuse("no web search", lambda v: v is not None, {}, (CHAT,)),
    # ignored: they cannot change the output
    "user": _ignore("an end-user id for abuse monitoring"),
    "metadata": _ignore("stored with nothing"),
    "store": _ignore("nothing is stored"),
    "service_tier": _ignore("one tier"),
    "request_id": _ignore("the server assigns its own (X-Request-Id)"),
    "cache_prompt": _ignore("llama.cpp server: prefix caching is always on"),
    "id_slot": _ignore("llama.cpp server: no slots"),
    "guided_decoding_backend": _ignore("xgrammar is the only backend"),
    "prediction": _ignore("predicted outputs only speed a response up"),
    "mirostat_tau": _ignore("only acts with mirostat, which is refused"),
    "mirostat_eta": _ignore("only acts with mirostat, which is refused"),
})


def field_name(key: str) -> str:
    """The request field a table key stands for (`echo@chat` is `echo` on the chat route)."""
    return key.partition("@")[0]


def refuse_unsupported(body: dict[str, Any], route: str) -> None:
    """400 naming the first field in `body` whose value this server refuses on `route`."""
    for key, fate in REQUEST_FIELDS.items():
        name = field_name(key)
        if fate.fate == REFUSED and route in fate.routes and name in body and fate.refused_if(body[name]):
            raise bad_request(f"'{name}' is not supported by this server: {fate.why}.", name,
                              "unsupported_parameter")
