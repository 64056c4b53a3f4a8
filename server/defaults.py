"""Request defaults from the served model: a Hugging Face folder's generation_config.json, as vLLM's
`--generation-config auto` reads it (temperature, top_p, top_k, min_p, repetition_penalty), plus the
`--default-max-tokens` cap."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from server.protocol import RequestDefaults

GENERATION_FIELDS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float,
                     "repetition_penalty": float}


def generation_config(path: Path | None) -> dict[str, Any]:
    """The sampling defaults a model folder's generation_config.json names (those of GENERATION_FIELDS with a
    usable value); {} for a GGUF file, a folder without one, or a file that is not JSON."""
    if path is None or not Path(path).is_dir():
        return {}
    try:
        raw = json.loads((Path(path) / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict):
        return {}
    found = {}
    for name, kind in GENERATION_FIELDS.items():
        value = raw.get(name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            found[name] = kind(value)
    if found.get("top_k") == 0:
        found["top_k"] = -1  # transformers' "no top-k"
    return found


def request_defaults(path: Path | None, mode: str, default_max_tokens: int | None
                     ) -> tuple[RequestDefaults, dict[str, Any]]:
    """(the defaults, the model's own share of them): mode "auto" applies generation_config.json, "none" not."""
    from_model = generation_config(path) if mode == "auto" else {}
    return RequestDefaults(**from_model, max_tokens=default_max_tokens), from_model
