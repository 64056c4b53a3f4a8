"""A budget of thinking tokens: once an output has spent `tokens` inside its think block without closing it,
the next token is forced to be the closing tag (a mask over the logits, like a grammar's), so the answer
follows. Anthropic's `thinking.budget_tokens` is enforced this way.

A budget is a SamplingParams field as plain integers, so that it crosses the wire as it is:
`(tokens, open_id, close_id)`, where `open_id` is -1 when the output starts inside the block (the prompt
opened it, or the model thinks until the close tag without opening it: DeepSeek-R1), and the token the block
opens with otherwise (an output that never opens it never thinks, and is never forced). Both tags must be
single tokens of the vocabulary (the front door checks it). Kept light: no torch at import.
"""
from __future__ import annotations

from typing import Any, Sequence

INSIDE = -1  # open_id of an output that starts inside the think block


def check_budget(value: Any) -> tuple[int, int, int]:
    """`value` as (tokens, open_id, close_id); ValueError when it is not three integers with tokens >= 0,
    open_id >= -1 and close_id >= 0."""
    if not isinstance(value, (tuple, list)) or len(value) != 3 or \
            not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"thinking_budget must be (tokens, open token id or -1, close token id), got {value!r}.")
    tokens, open_id, close_id = value
    if tokens < 0 or open_id < INSIDE or close_id < 0:
        raise ValueError(f"thinking_budget must hold tokens >= 0, an open id >= -1 and a close id >= 0, "
                         f"got {tuple(value)!r}.")
    return tokens, open_id, close_id


def thinking_spent(budget: Sequence[int], output: Sequence[int]) -> int | None:
    """How many tokens `output` (the output tokens so far) has written inside an open think block; None when
    it is not inside one (never opened it, or closed it)."""
    _, open_id, close_id = budget
    start = 0
    if open_id != INSIDE:
        try:
            start = list(output).index(open_id) + 1
        except ValueError:
            return None
    if close_id in output[start:]:
        return None
    return len(output) - start


def must_close(budget: Sequence[int], output: Sequence[int]) -> bool:
    """Whether the token after `output` must be the closing tag: the block is open and its budget spent."""
    spent = thinking_spent(budget, output)
    return spent is not None and spent >= budget[0]


def forced_rows(budget: Sequence[int], output: Sequence[int], drafts: Sequence[int]) -> list[bool]:
    """For each of the len(drafts) + 1 positions after `output` and its first j drafts: whether the token there
    must be the closing tag (speculative verification judges each draft by it)."""
    history = list(output)
    rows = []
    for j in range(len(drafts) + 1):
        rows.append(must_close(budget, history))
        if j < len(drafts):
            history.append(drafts[j])
    return rows
