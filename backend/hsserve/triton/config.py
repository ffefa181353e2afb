"""AdapterConfig: the Triton adapter's own settings; config.pbtxt `parameters` are split between
it and the EngineConfig, each validated once."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

from hsserve.engine.config import ConfigError, EngineConfig, parse_fields


@dataclass(frozen=True)
class AdapterConfig:
    # NOTE: the engine's loop in a child process, with a GIL of its own (bench/README.md#engine-process);
    # false: a thread of the Python stub
    engine_process: bool = True
    # NOTE: when the server stops, requests in flight may finish for this long, then the rest end
    # with UNAVAILABLE (keep it below tritonserver's --exit-timeout-secs)
    drain_timeout_s: float = 5.0
    # NOTE: streamed responses a second over all requests; above it a response carries several
    # tokens (bench/README.md#response-sender). 0 = one response per token
    stream_responses_per_s: int = 4000
    # NOTE: a streamed response each this many tokens (the first at once), at most this many in
    # one; a request's own `stream_interval` overrides it
    stream_interval: int = 1
    default_max_tokens: int = 16  # a request's max_tokens when it gives none
    # NOTE: a request that does not say: false answers as vllm_backend does (a non-streamed
    # text_output starts with the prompt); true (ours): the completion only
    exclude_input_in_output: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.drain_timeout_s <= 3600.0:
            raise ConfigError(f"drain_timeout_s: {self.drain_timeout_s} must be in 0..3600")
        if self.stream_responses_per_s < 0:
            raise ConfigError(f"stream_responses_per_s: must be >= 0, got {self.stream_responses_per_s}")
        if self.stream_interval < 1:
            raise ConfigError(f"stream_interval: must be >= 1, got {self.stream_interval}")
        if self.default_max_tokens < 0:
            raise ConfigError(f"default_max_tokens: must be >= 0, got {self.default_max_tokens}")


_ADAPTER_KEYS = frozenset(f.name for f in fields(AdapterConfig))
_ENGINE_KEYS = frozenset(f.name for f in fields(EngineConfig)) - {"hidden_dtype"}


def split_parameters(params: Mapping[str, Any],
                     hidden_dtype: str = "float32") -> tuple[AdapterConfig, EngineConfig]:
    """config.pbtxt parameters -> (adapter, engine) configs; `hidden_dtype` comes from the
    HIDDEN_STATES output's data_type, never from a parameter."""
    unknown = sorted(set(params) - _ADAPTER_KEYS - _ENGINE_KEYS)
    if unknown:
        raise ConfigError(f"unknown parameter {unknown[0]!r}; known: "
                          f"{sorted(_ADAPTER_KEYS | _ENGINE_KEYS)}")
    adapter = AdapterConfig(**parse_fields(
        AdapterConfig, {k: v for k, v in params.items() if k in _ADAPTER_KEYS}))
    engine = EngineConfig.from_parameters({k: v for k, v in params.items() if k in _ENGINE_KEYS})
    if adapter.default_max_tokens > engine.max_tokens_limit:
        raise ConfigError(f"default_max_tokens: {adapter.default_max_tokens} must be in "
                          f"0..max_tokens_limit ({engine.max_tokens_limit})")
    return adapter, replace(engine, hidden_dtype=hidden_dtype)
