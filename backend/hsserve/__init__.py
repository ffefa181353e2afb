"""hsserve: an LLM engine that returns hidden states, served from Triton Inference Server."""

from hsserve.engine.config import EngineConfig
from hsserve.engine.loop import Engine
from hsserve.request import (
    Delta,
    EngineUnavailable,
    FinishReason,
    GenerationRequest,
    HiddenStatesMode,
    RequestError,
    SamplingParams,
)
from hsserve.engine.request_stream import RequestStream, Result

__all__ = [
    "Delta",
    "Engine",
    "EngineUnavailable",
    "EngineConfig",
    "FinishReason",
    "GenerationRequest",
    "HiddenStatesMode",
    "RequestError",
    "RequestStream",
    "Result",
    "SamplingParams",
]
