"""JSON grammars that close: xgrammar's grammar of a JSON schema with its numbers bounded in digits and its
whitespace bounded between tokens, as llama.cpp's json-schema-to-grammar writes them.

xgrammar lets a number run to any length and (without a count) any whitespace between tokens, so a small
model can loop on `1111…` or on blank lines until max_tokens. Here:
- an integer part has at most INTEGER_DIGITS digits, a fraction and an exponent at most FRACTION_DIGITS;
- between two tokens goes nothing, one space, or one newline and at most MAX_INDENT spaces or tabs.

Only repetitions xgrammar leaves open are bounded: a schema that asks for wider gets it. `minimum` and
`maximum` together are spelt by xgrammar as the exact range (so `maximum: 1e18` allows 19 digits), and a
string's `pattern` is the schema's own regex, never touched. A half-open range (`minimum: 0` alone) is bounded
on its open side.

The bounds are applied to xgrammar's printed EBNF, token by token: string literals, regexes and character
classes other than the digit and whitespace ones pass through unchanged, so no property name or pattern is
rewritten. The tests pin the shapes this relies on (tests/test_json_grammar.py).
"""
from __future__ import annotations

import json
import re
from typing import Any

INTEGER_DIGITS = 16
FRACTION_DIGITS = 16
MAX_INDENT = 20
JSON_OBJECT = '{"type": "object"}'  # the schema of a json_object constraint: any object
WS_RULE = "bounded_ws"
WS_EBNF = f'{WS_RULE} ::= "" | " " | "\\n" [ \\t]{{0,{MAX_INDENT}}}'

# One EBNF token: a string literal, a character class, a repetition range, a name, a space run, any other char.
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|\{\s*-?\d+\s*,\s*-?\d+\s*\}|[A-Za-z_][A-Za-z0-9_]*'
                    r'|\s+|.', re.S)
_RANGE = re.compile(r"\{\s*(\d+)\s*,\s*(-?\d+)\s*\}")
_DIGIT_RULE = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*) ::= \(\(\[0-9\]\)\)$", re.M)
DIGITS = "[0-9]"
NONZERO = "[1-9]"
JSON_WS = r"[ \n\r\t]"


def json_schema_ebnf(schema: Any) -> str:
    """The bounded EBNF of `schema` (a dict, a bool or JSON text); xgrammar's errors propagate."""
    import xgrammar as xgr  # noqa: PLC0415 - only engines that serve constraints load it

    source = schema if isinstance(schema, str) else json.dumps(schema)
    grammar = xgr.Grammar.from_json_schema(source, any_whitespace=True, strict_mode=True, max_whitespace_cnt=None)
    return bound_ebnf(str(grammar))


def bound_ebnf(ebnf: str) -> str:
    """xgrammar's printed JSON grammar with every open digit repetition bounded and every open whitespace run
    replaced by the bounded whitespace rule."""
    if re.search(rf"^{WS_RULE} ::=", ebnf, re.M):
        raise ValueError(f"the grammar already has a rule named {WS_RULE}")
    digit_rules = {DIGITS} | set(_DIGIT_RULE.findall(ebnf))
    tokens = [m.group(0) for m in _TOKEN.finditer(ebnf)]
    out: list[str] = []
    before, previous = "", ""  # the last two tokens that were not space runs
    for i, token in enumerate(tokens):
        following = tokens[i + 1] if i + 1 < len(tokens) else ""
        if token == JSON_WS and following == "*":
            tokens[i + 1] = ""  # the star goes with the class
            token = WS_RULE
        elif token in ("*", "+") or _is_open_range(token):
            token = _bounded(token, previous, before, digit_rules)
        out.append(token)
        if token.strip():
            before, previous = previous, token
    return "".join(out) + "\n" + WS_EBNF + "\n"


def _is_open_range(token: str) -> bool:
    m = _RANGE.fullmatch(token)
    return m is not None and m.group(2) == "-1"


def _bounded(token: str, repeated: str, before: str, digit_rules: set[str]) -> str:
    """The repetition `token` of `repeated`, bounded where `repeated` is a digit: after a leading 1-9 it is the
    rest of an integer part, otherwise a fraction's or an exponent's digits."""
    if repeated not in digit_rules:
        return token
    low = {"*": 0, "+": 1}.get(token)
    if low is None:
        low = int(_RANGE.fullmatch(token).group(1))
    most = INTEGER_DIGITS - 1 if before == NONZERO else FRACTION_DIGITS
    return "{" + f"{low}, {max(low, most)}" + "}"


def bounded_structural_tag(source: str) -> str:
    """A structural tag (JSON text) whose json_schema parts are bounded grammars: each JSON-style
    `json_schema` content becomes a `grammar` content holding json_schema_ebnf of its schema."""
    return json.dumps(_bounded_format(json.loads(source)))


def _bounded_format(node: Any) -> Any:
    if isinstance(node, list):
        return [_bounded_format(x) for x in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema" and node.get("style", "json") == "json" and "json_schema" in node:
        return {"type": "grammar", "grammar": json_schema_ebnf(node["json_schema"])}
    return {k: _bounded_format(v) for k, v in node.items()}
