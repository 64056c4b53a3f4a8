"""A request's constraint is compiled where the engine runs, once, before the request reaches the step
thread: the front ends only build it as text. Compiling it takes a while for a new schema, so the engine's
callers do it on a worker thread (engine.core.engine_core.EngineCore.prepare_request, the prefill actor)."""
from __future__ import annotations

from engine.core.errors import GUIDE_PARAM, RequestError
from engine.model.loader import ModelSource
from engine.sampling.structured import Guide, GuideError, source_compiler


def compile_constraint(source: ModelSource, guide: Guide) -> None:
    """Compile `guide` for `source`'s vocabulary into the process's cache; RequestError naming GUIDE_PARAM
    with the grammar engine's message when it cannot."""
    try:
        source_compiler(source).compile(guide)
    except GuideError as exc:
        raise RequestError(str(exc), GUIDE_PARAM) from None


def is_compiled(source: ModelSource, guide: Guide) -> bool:
    return source_compiler(source).cached(guide)
