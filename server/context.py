"""What every handler of one app shares: the engine client, settings, metrics and admission control."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web

from client import AsyncLLM
from frontend.front_door import FrontDoor
from server.admission import Admission
from server.defaults import request_defaults
from server.metrics import ServerMetrics
from server.protocol import ModelLimits, RequestDefaults
from server.quadrant import TreatmentOptions
from server.settings import ServerSettings


def _request_key(name: str, kind: type) -> Any:
    # Typed request keys arrived in aiohttp 3.14; older versions take plain strings.
    key_type = getattr(web, "RequestKey", None)
    return name if key_type is None else key_type(name, kind)


REQUEST_ID = _request_key("phase_serve_request_id", str)  # per-request storage (aiohttp requests are mappings)
TRACKER = _request_key("phase_serve_tracker", object)
API_ERROR = _request_key("phase_serve_api_error", object)  # the error the response reports, for the access line


@dataclass(frozen=True)
class ServerContext:
    llm: AsyncLLM
    settings: ServerSettings
    limits: ModelLimits
    dtype: str
    metrics: ServerMetrics
    admission: Admission
    log: structlog.stdlib.BoundLogger
    created: int  # unix time the app was built; the model card's `created`
    treatment: TreatmentOptions  # what treatment_for() may give each quadrant
    defaults: RequestDefaults  # what a request that leaves fields out gets
    generation_defaults: dict[str, Any]  # the model's own defaults among them (generation_config.json)
    front_door: FrontDoor  # requests -> what the engine runs, in the served model's tool-call and reasoning formats

    @classmethod
    def build(cls, llm: AsyncLLM, settings: ServerSettings, log: structlog.stdlib.BoundLogger) -> ServerContext:
        limits = ModelLimits(settings.served_model_name or llm.model_name, llm.max_model_len,
                             llm.source.config.vocab_size)
        dtype = llm.dtype_name
        metrics = ServerMetrics(llm.stats, limits.name, limits.max_model_len, llm.actors, llm.counters, llm.layout_status)
        defaults, from_model = request_defaults(llm.source.path, settings.generation_config,
                                                settings.default_max_tokens)
        door = FrontDoor.for_source(llm.source, settings.tool_call_parser, settings.reasoning_parser)
        return cls(llm, settings, limits, dtype, metrics, Admission(settings.max_queue), log, int(time.time()),
                   treatment_options(llm, settings), defaults, from_model, door)


CONTEXT = web.AppKey("phase_serve_context", ServerContext)


def treatment_options(llm: AsyncLLM, settings: ServerSettings) -> TreatmentOptions:
    return TreatmentOptions(speculation=llm.config.speculative != "off", kv_compress=llm.config.kv_compress != "none",
                            speculate_quadrants=settings.speculate_quadrants)
