"""/tokenize and /detokenize in vLLM's shapes. Neither reaches the engine."""
from __future__ import annotations

from typing import Any

from aiohttp import web

from frontend.front_door import ChatTools
from server.context import CONTEXT, ServerContext
from server.errors import bad_request, invalid_type
from server.generation import read_body, render_chat
from server.protocol import (check_model_name, parse_json_body, parse_messages, parse_template_kwargs,
                             parse_tool_fields)

# Chat-template options of vLLM's tokenize that this server does not implement; given, they get a 400.
UNSUPPORTED_CHAT_OPTIONS = ("continue_final_message", "chat_template")


async def tokenize(request: web.Request) -> web.Response:
    """vLLM's shape: `{"model"?, "prompt", "add_special_tokens"?: true}` or `{"model"?, "messages",
    "add_generation_prompt"?: true, "add_special_tokens"?: false, "tools"?}`, and `return_token_strs`; answers
    `{"tokens", "count", "max_model_len", "token_strs"}`. Prompts longer than the context are counted, not
    refused: telling a client so is what this route is for."""
    ctx = request.app[CONTEXT]
    body = await _body(request, ctx)
    tokens = await _tokens(ctx, body)
    strs = None
    if _flag(body, "return_token_strs", False):
        strs = [ctx.llm.tokenizer.id_to_token(t) for t in tokens]
    return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": ctx.limits.max_model_len,
                              "token_strs": strs})


async def detokenize(request: web.Request) -> web.Response:
    """vLLM's shape: `{"model"?, "tokens": [ids]}` -> `{"prompt": text}`, special tokens spelled out."""
    ctx = request.app[CONTEXT]
    body = await _body(request, ctx)
    tokens = body.get("tokens")
    if tokens is None:
        raise bad_request("'tokens' is required.", "tokens", "missing_required_parameter")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise invalid_type("tokens", "an array of token ids", tokens)
    vocab = ctx.limits.vocab_size
    bad = next((t for t in tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"'tokens' holds token id {bad}, outside this model's vocabulary of {vocab}.", "tokens")
    return web.json_response({"prompt": ctx.llm.tokenizer.decode(tokens, skip_special_tokens=False)})


# ---------------------------------------------------------------------------------------- helpers

async def _body(request: web.Request, ctx: ServerContext) -> dict[str, Any]:
    body = parse_json_body(await read_body(request, ctx.settings.max_body_bytes))
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise invalid_type("model", "a string", model)
        check_model_name(model, ctx.limits.name)
    return body


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid_type(name, "a boolean", value)
    return value


async def _tokens(ctx: ServerContext, body: dict[str, Any]) -> list[int]:
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt and has_messages:
        raise bad_request("give one of 'prompt' (text) and 'messages' (a chat), not both.", "messages")
    if not has_prompt and not has_messages:
        raise bad_request("'prompt' (text) or 'messages' (a chat) is required.", "prompt",
                          "missing_required_parameter")
    if has_prompt:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise invalid_type("prompt", "a string", prompt)
        return await ctx.front_door.encode_async(prompt, _flag(body, "add_special_tokens", True))
    for name in UNSUPPORTED_CHAT_OPTIONS:
        if body.get(name) not in (None, False, {}):
            raise bad_request(f"'{name}' is not supported by this server's /tokenize.", name, "unsupported_parameter")
    tools, _ = parse_tool_fields(body)
    text = render_chat(ctx.front_door, parse_messages(body["messages"]), ChatTools(tools),
                       _flag(body, "add_generation_prompt", True), parse_template_kwargs(body))
    return await ctx.front_door.encode_async(text, _flag(body, "add_special_tokens", False))
