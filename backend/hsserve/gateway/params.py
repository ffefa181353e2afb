"""An OpenAI request body -> a Generation: validated once, every bad field refused naming it.

The sampling fields map onto the `llm` model's sampling_parameters JSON (SPEC.md); the engine
validates ranges it alone knows (max_tokens limit, n, logprobs), and its error names the input,
which errors.from_backend turns back into the OpenAI field. Fields the engine cannot honour
(penalties, logit_bias, tools, best_of above n) are refused rather than ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hsserve.gateway.errors import invalid

_ROLES = ("system", "developer", "user", "assistant", "tool")
_UNSUPPORTED_ZERO = ("presence_penalty", "frequency_penalty")
_UNSUPPORTED_EMPTY = ("logit_bias", "tools", "functions", "suffix")


@dataclass(frozen=True)
class HiddenSpec:
    """The hidden_states extension: {"mode": "last"|"full", "layers": [...],
    "encoding_format": "base64"|"float"}."""
    mode: str
    layers: tuple[int, ...] | None
    encoding: str = "base64"


@dataclass(frozen=True)
class Generation:
    chat: bool
    model: str
    prompts: tuple  # completions: str or tuple[int] each; chat: the messages (one prompt)
    stream: bool = False
    include_usage: bool = False
    n: int = 1
    echo: bool = False
    logprobs: int | None = None  # alternatives per token; None: no logprobs
    hidden: HiddenSpec | None = None
    settings: dict = field(default_factory=dict)  # the sampling_parameters JSON
    rename: dict = field(default_factory=dict)  # engine field -> the name this request used


def _int(body: dict, name: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise invalid(name, f"must be an integer, got {v!r}")
    if v < lo or (hi is not None and v > hi):
        raise invalid(name, f"{v} is outside {lo}..{hi if hi is not None else 'inf'}")
    return v


def _num(body: dict, name: str, lo: float, hi: float) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise invalid(name, f"must be a number, got {v!r}")
    if not lo <= v <= hi:
        raise invalid(name, f"{v} is outside {lo}..{hi}")
    return float(v)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(name, f"must be true or false, got {v!r}")
    return v


def _stop(body: dict) -> list[str] | None:
    v = body.get("stop")
    if v is None:
        return None
    v = [v] if isinstance(v, str) else v
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise invalid("stop", "must be a non-empty string or a list of non-empty strings")
    return v


def _hidden(body: dict) -> HiddenSpec | None:
    v = body.get("hidden_states")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise invalid("hidden_states", 'must be an object: {"mode": "last"|"full", "layers": '
                      '[...], "encoding_format": "base64"|"float"}')
    unknown = sorted(set(v) - {"mode", "layers", "encoding_format"})
    if unknown:
        raise invalid("hidden_states", f"unknown field(s) {unknown}; allowed: mode, layers, "
                      "encoding_format")
    mode = v.get("mode", "last")
    if mode not in ("last", "full"):
        raise invalid("hidden_states.mode", f"{mode!r}; allowed: 'last', 'full'")
    layers = v.get("layers")
    if layers is not None and (not isinstance(layers, list) or not layers or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in layers)):
        raise invalid("hidden_states.layers", "must be a non-empty list of integers (HF "
                      "hidden_states indices, negative from the end)")
    enc = v.get("encoding_format", "base64")
    if enc not in ("base64", "float"):
        raise invalid("hidden_states.encoding_format", f"{enc!r}; allowed: 'base64', 'float'")
    return HiddenSpec(mode, tuple(layers) if layers else None, enc)


def _refuse_unsupported(body: dict) -> None:
    for name in _UNSUPPORTED_ZERO:
        if body.get(name) not in (None, 0, 0.0):
            raise invalid(name, "is not supported by this server (only 0)")
    for name in _UNSUPPORTED_EMPTY:
        if body.get(name):
            raise invalid(name, "is not supported by this server")


# NOTE: vLLM's request extras for the same structured outputs, each one guided_decoding kind
_GUIDED_EXTRAS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


def _response_format(fmt: Any) -> dict | None:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise invalid("response_format.json_schema", "must be {\"name\": ..., \"schema\": "
                          "{a JSON schema}}")
        return {"json": spec.get("schema", {})}  # NOTE: no schema: any JSON value, as OpenAI's
    raise invalid("response_format", "type must be one of 'text', 'json_object', 'json_schema'")


def _guided(body: dict) -> tuple[dict | None, str]:
    """The request's structured output as the engine's guided_decoding, and the field it came
    from (response_format, a vLLM guided_* extra, or structured_outputs); at most one."""
    given = [n for n in ("response_format", *_GUIDED_EXTRAS, "structured_outputs")
             if body.get(n) is not None]
    if len(given) > 1:
        raise invalid(given[1], f"give one of {given}, not several")
    if not given:
        return None, ""
    name = given[0]
    if name == "response_format":
        return _response_format(body[name]), name
    if name == "structured_outputs":
        if not isinstance(body[name], dict):
            raise invalid(name, "must be an object (vLLM's structured_outputs)")
        return body[name], name
    return {_GUIDED_EXTRAS[name]: body[name]}, name


def _common(body: dict, chat: bool) -> dict[str, Any]:
    """The fields both endpoints share -> Generation keyword arguments."""
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise invalid("model", "is required: the name /v1/models lists")
    _refuse_unsupported(body)
    n = _int(body, "n", 1) or 1
    best_of = _int(body, "best_of", 1)
    if best_of is not None and best_of != n:
        raise invalid("best_of", f"{best_of}: only best_of = n ({n}) is supported")
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and (not stream or not isinstance(opts, dict)):
        raise invalid("stream_options", "is an object, allowed only with stream: true")
    settings: dict[str, Any] = {"n": n}
    rename: dict[str, str] = {}
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    for name in names:
        v = _int(body, name, 0)
        if v is not None:
            settings["max_tokens"] = v
            rename["max_tokens"] = name
            break
    for name, lo, hi in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0)):
        v = _num(body, name, lo, hi)
        if v is not None:
            settings[name] = v
    for name, lo in (("seed", 0), ("top_k", -1), ("min_tokens", 0)):
        v = _int(body, name, lo)
        if v is not None:
            settings[name] = v
    if (stop := _stop(body)) is not None:
        settings["stop"] = stop
    ids = body.get("stop_token_ids")
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise invalid("stop_token_ids", "must be a list of token ids")
        settings["stop_token_ids"] = ids
    if "ignore_eos" in body:
        settings["ignore_eos"] = _bool(body, "ignore_eos")
    guided, source = _guided(body)
    if guided is not None:
        settings["guided_decoding"] = guided
        rename["response_format"] = source
    hidden = _hidden(body)
    if hidden is not None:
        settings["MODE"] = hidden.mode
        if hidden.layers is not None:
            settings["hidden_layers"] = list(hidden.layers)
    return dict(model=body["model"], stream=stream, n=n, hidden=hidden, settings=settings,
                include_usage=bool(opts and _bool(opts, "include_usage")), rename=rename)


def _prompts(v: Any) -> tuple:
    """prompt: a string, a list of strings, a list of token ids, or a list of such lists."""
    def ids(x) -> bool:
        return isinstance(x, list) and bool(x) and all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in x)

    if isinstance(v, str):
        return (v,)
    if ids(v):
        return (tuple(v),)
    if isinstance(v, list) and v and all(isinstance(p, str) or ids(p) for p in v):
        return tuple(p if isinstance(p, str) else tuple(p) for p in v)
    raise invalid("prompt", "must be a string, a list of strings, a non-empty list of token "
                  "ids, or a list of such lists")


def completion(body: dict) -> Generation:
    kw = _common(body, chat=False)
    logprobs = _int(body, "logprobs", 0)
    echo = _bool(body, "echo")
    if "max_tokens" not in kw["settings"]:
        kw["settings"]["max_tokens"] = 16  # NOTE: OpenAI's default for completions
    if logprobs is not None:
        kw["settings"]["num_logprobs"] = logprobs
        if echo:
            kw["settings"]["prompt_logprobs"] = logprobs
    return Generation(chat=False, prompts=_prompts(body.get("prompt")), echo=echo,
                      logprobs=logprobs, **kw)


def _messages(v: Any) -> tuple:
    if not isinstance(v, list) or not v:
        raise invalid("messages", "must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise invalid(f"{where}.role", f"must be one of {list(_ROLES)}")
        content = m.get("content")
        if isinstance(content, list):  # NOTE: content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise invalid(f"{where}.content", "only text parts ({\"type\": \"text\", "
                              "\"text\": ...}) are supported")
            content = "".join(p["text"] for p in content)
        if content is None and m["role"] == "assistant":
            content = ""
        if not isinstance(content, str):
            raise invalid(f"{where}.content", "must be a string or a list of text parts")
        out.append({"role": m["role"], "content": content})
    return tuple(out)


def chat(body: dict) -> Generation:
    kw = _common(body, chat=True)
    logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, 20)
    if top is not None and not logprobs:
        raise invalid("top_logprobs", "needs logprobs: true")
    k = (top or 0) if logprobs else None
    if k is not None:
        kw["settings"]["num_logprobs"] = k
    kw["rename"].update(prompt="messages", logprobs="top_logprobs")
    return Generation(chat=True, prompts=_messages(body.get("messages")), logprobs=k, **kw)
