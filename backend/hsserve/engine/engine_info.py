"""EngineInfo: what a started engine found (the model and the limits derived from it), which
admission checks requests against and the engine process sends back in its Ready event."""

from __future__ import annotations

from dataclasses import dataclass

from hsserve.models.spec import ModelSpec


@dataclass(frozen=True)
class EngineInfo:
    """What a started engine found: the model and the limits derived from it."""

    spec: ModelSpec
    tokenizer: object | None
    max_model_len: int
    max_prompt_tokens: int
    captured_layers: tuple[int, ...]
    device: str
    graph_captures: int
