"""OpenAI-style errors: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

from __future__ import annotations


class ApiError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.kind, self.code = (
            message, param, status, kind, code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def invalid(param: str, message: str) -> ApiError:
    """A bad field: 400 naming it (message starts with the field's name)."""
    return ApiError(f"{param}: {message}", param=param)


# NOTE: the Triton input a backend error names -> the OpenAI field it came from
_FIELDS = {"max_tokens": "max_tokens", "min_tokens": "min_tokens", "temperature": "temperature",
           "top_p": "top_p", "top_k": "top_k", "seed": "seed", "stop": "stop", "n": "n",
           "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos",
           "num_logprobs": "logprobs", "prompt_logprobs": "logprobs",
           "MODE": "hidden_states.mode", "hidden_layers": "hidden_states.layers",
           "input_ids": "prompt", "text_input": "prompt", "guided_decoding": "response_format"}
_UNAVAILABLE = ("the queue is full", "the engine is not serving", "the engine process is gone")


def from_backend(message: str, rename: dict[str, str] | None = None) -> ApiError:
    """Triton's error text for one request -> 400 naming the field (`rename`: the request's own
    name for it, e.g. chat's messages), 503 when the server cannot take it now, else 500."""
    text = message.split("] ", 1)[-1] if message.startswith("[") else message
    if any(s in text for s in _UNAVAILABLE):
        return ApiError(text, status=503, kind="server_error", code="overloaded")
    # NOTE: "sampling_parameters.guided_decoding.json: ..." names guided_decoding
    name = text.split(":", 1)[0].strip().removeprefix("sampling_parameters.").split(".")[0]
    if name in _FIELDS:
        param = _FIELDS[name]
        return ApiError(text, param=(rename or {}).get(param, param))
    if "cancel" in text:
        return ApiError(text, status=499, kind="cancelled")
    return ApiError(text, status=500, kind="server_error")
