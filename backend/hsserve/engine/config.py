"""EngineConfig: every server-side setting, parsed from config.pbtxt parameters and validated once."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Mapping

from hsserve.request import HiddenStatesMode

# NOTE: models/fp8.py AT_LOAD holds what each one means
QUANTIZATIONS = ("none", "fp8", "fp8_dynamic")

DEFAULT_MODEL = "default"
_DTYPES = ("auto", "float32", "bfloat16", "float16")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    load_format: str = "auto"  # auto: the folder's safetensors; dummy: random weights (benchmarks)
    # NOTE: fp8 / fp8_dynamic: a bf16 / float32 checkpoint's linears quantized at load
    # (models/fp8.py; fp8_dynamic rounds their inputs per token too); a float8 checkpoint (its
    # quantization_config) loads as it is either way
    quantization: str = "none"
    device: str = "auto"  # auto = cuda when available, else cpu
    hidden_states_ceiling: HiddenStatesMode = HiddenStatesMode.FULL
    # NOTE: None = every layer 0..L; else HF hidden_states indices (negative from the end).
    hidden_layers_captured: tuple[int, ...] | None = None
    max_num_seqs: int = 64
    # NOTE: requests in flight beyond max_num_seqs; one more is refused (UNAVAILABLE)
    max_queue_size: int = 256
    max_model_len: int = 0  # 0 = the model's max_position_embeddings
    max_prompt_tokens: int = 0  # 0 = max_model_len
    max_tokens_limit: int = 4096
    max_logprobs: int = 20  # top alternatives a request may ask for per token
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_memory_fraction: float = 0.9  # GPU: of free memory; CPU: of available RAM, see kv_cache_max_bytes
    kv_cache_max_bytes: int = 2 << 30  # CPU ceiling for the pool
    num_kv_blocks: int = 0  # >0 overrides the memory-derived size (tests, small pools)
    enable_prefix_caching: bool = True
    enable_cuda_graph: bool = True
    # NOTE: queue decode step t+1 before reading step t, so the loop's Python (reading, stop
    # checks, publishing, scheduling) runs while the device computes. auto = on for CUDA.
    async_scheduling: str = "auto"
    # NOTE: while sequences decode, a new prompt waits up to this long for others, so that prompts
    # arriving close together prefill in one step (a step that prefills runs outside the CUDA
    # graphs, and on the GPU costs a few decode steps); 0 = admit at once
    prefill_wait_ms: float = 0.0
    hidden_dtype: str = "float32"  # rows handed out in this dtype (Triton: HIDDEN_STATES's)
    cache_dir: str = ""  # where the default model is converted; "" = ~/.cache/hsserve
    num_threads: int = 0  # CPU torch threads; 0 = torch's default
    # NOTE: ranks the model is split over (processes of the engine's own; GPUs from the engine's)
    tensor_parallel_size: int = 1
    # NOTE: speculative decoding (engine/speculative.py): none | ngram | eagle3; k tokens proposed
    # a step; ngram_min / ngram_max: the suffix lengths prompt lookup tries (0: 1 and 4);
    # speculative_model: eagle3's head (a folder, models/eagle3.py)
    speculative_method: str = "none"
    num_speculative_tokens: int = 0
    speculative_model: str = ""
    ngram_min: int = 0
    ngram_max: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype: {self.dtype!r} not in {_DTYPES}")
        if self.load_format not in ("auto", "dummy"):
            raise ConfigError(f"load_format: {self.load_format!r}; allowed: auto, dummy")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization: {self.quantization!r}; allowed: "
                              + ", ".join(QUANTIZATIONS))
        if self.hidden_dtype not in _DTYPES[1:]:
            raise ConfigError(f"hidden_dtype: {self.hidden_dtype!r} not in {_DTYPES[1:]}")
        if self.async_scheduling not in ("auto", "on", "off"):
            raise ConfigError(f"async_scheduling: {self.async_scheduling!r}; allowed: auto, on, off")
        if self.device != "auto" and not self.device.startswith(("cpu", "cuda")):
            raise ConfigError(f"device: {self.device!r}; allowed: auto, cpu, cuda[:N]")
        for name in ("max_num_seqs", "block_size", "max_num_batched_tokens", "max_tokens_limit",
                     "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("max_model_len", "max_prompt_tokens", "num_kv_blocks", "num_threads",
                     "max_queue_size", "max_logprobs"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # NOTE: every running sequence's decode fits in one step's token budget
            raise ConfigError(
                f"max_num_batched_tokens: {self.max_num_batched_tokens} must be >= max_num_seqs "
                f"({self.max_num_seqs})"
            )
        if not 0.0 <= self.prefill_wait_ms <= 1000.0:
            raise ConfigError(f"prefill_wait_ms: {self.prefill_wait_ms} must be in 0..1000")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ConfigError("kv_cache_memory_fraction: must be in (0, 1]")
        check_speculative(self)

    @property
    def ngram_range(self) -> tuple[int, int]:
        """(min, max) suffix lengths of prompt lookup, defaults filled in."""
        return self.ngram_min or 1, self.ngram_max or max(4, self.ngram_min)

    @classmethod
    def from_parameters(cls, params: Mapping[str, Any]) -> EngineConfig:
        """Parse string values (config.pbtxt `parameters`) into a validated config; unknown keys
        are refused so that a typo does not silently fall back to a default."""
        return cls(**parse_fields(cls, params))


def check_speculative(c: EngineConfig) -> None:
    """Refuse a speculative setting that means nothing with the others, naming it."""
    method, k = c.speculative_method, c.num_speculative_tokens
    if method not in ("none", "ngram", "eagle3"):
        raise ConfigError(f"speculative_method: {method!r}; allowed: none, ngram, eagle3")
    if method == "none":
        for name in ("num_speculative_tokens", "speculative_model", "ngram_min", "ngram_max"):
            if getattr(c, name):
                raise ConfigError(f"{name}: set while speculative_method is none")
        return
    if not 1 <= k <= 32:
        raise ConfigError(f"num_speculative_tokens: {k} must be in 1..32 with speculative_method "
                          f"{method}")
    if k >= c.max_num_batched_tokens:
        raise ConfigError(f"num_speculative_tokens: {k} must be < max_num_batched_tokens "
                          f"({c.max_num_batched_tokens})")
    if method == "eagle3":
        check_eagle3(c)
        return
    if c.speculative_model:
        raise ConfigError("speculative_model: a draft model is for eagle3; ngram proposes from "
                          "the sequence itself")
    for name in ("ngram_min", "ngram_max"):
        if not 0 <= getattr(c, name) <= 64:
            raise ConfigError(f"{name}: {getattr(c, name)} must be in 1..64 (0: the default)")
    lo, hi = c.ngram_range
    if lo > hi:
        raise ConfigError(f"ngram_min: {lo} must be <= ngram_max ({hi})")


def check_eagle3(c: EngineConfig) -> None:
    """The head's folder is read at load (models/eagle3.py names what does not fit)."""
    if not c.speculative_model:
        raise ConfigError("speculative_model: required with speculative_method eagle3 (a folder "
                          "with the EAGLE-3 head's config.json and weights)")
    if not os.path.exists(os.path.join(c.speculative_model, "config.json")):
        raise ConfigError(f"speculative_model: {c.speculative_model!r} is not a folder with "
                          "config.json")
    for name in ("ngram_min", "ngram_max"):
        if getattr(c, name):
            raise ConfigError(f"{name}: prompt lookup's; set while speculative_method is eagle3")
    if c.tensor_parallel_size > 1:
        raise ConfigError("speculative_method: eagle3 runs with tensor_parallel_size 1 only "
                          "(allowed with more ranks: none, ngram)")


def parse_fields(cls, params: Mapping[str, Any]) -> dict[str, Any]:
    """String values of a config dataclass's fields, parsed by each field's type."""
    known = {f.name: f for f in fields(cls)}
    values: dict[str, Any] = {}
    for key, raw in params.items():
        if key not in known:
            raise ConfigError(f"unknown parameter {key!r}; known: {sorted(known)}")
        values[key] = _parse_value(key, known[key].type, str(raw).strip())
    return values


def _parse_value(key: str, type_name: str, raw: str) -> Any:
    try:
        if key == "hidden_states_ceiling":
            return HiddenStatesMode.parse(raw, key)
        if key == "hidden_layers_captured":
            if raw.lower() in ("", "all"):
                return None
            return tuple(int(x) for x in raw.replace(",", " ").split())
        if type_name == "bool":
            if raw.lower() in _TRUE:
                return True
            if raw.lower() in _FALSE:
                return False
            raise ValueError(f"expected one of {_TRUE + _FALSE}")
        if type_name == "int":
            return int(raw)
        if type_name == "float":
            return float(raw)
        return raw
    except ValueError as e:
        raise ConfigError(f"{key}: cannot parse {raw!r}: {e}") from None
