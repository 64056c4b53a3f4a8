"""Request defaults from the served model: a Hugging Face folder's generation_config.json, as vLLM's
`--generation-config auto` reads it (the SamplingParams fields declared `generation_config=True`), plus the
`--default-max-tokens` cap."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from engine.sampling.fields import generation_config_names
from engine.sampling.sampling_params import SamplingParams
from server.protocol import RequestDefaults


def generation_fields() -> dict[str, type]:
    """The fields generation_config.json may set, each with the type of its default."""
    return {name: type(getattr(SamplingParams(), name)) for name in generation_config_names(SamplingParams)}


def generation_config(path: Path | None) -> dict[str, Any]:
    """The sampling defaults a model folder's generation_config.json names (those of generation_fields() with a
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
    for name, kind in generation_fields().items():
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
