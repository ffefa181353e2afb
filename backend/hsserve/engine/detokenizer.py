"""Incremental detokenization that never splits a UTF-8 character, and stop-string matching."""

from __future__ import annotations

from typing import Callable

_CONTEXT_TOKENS = 6  # prompt tokens decoded as left context (leading-space rules of some vocabularies)


def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """ids -> text, as tokenizer.decode(ids, skip_special_tokens=True) returns it. For a fast
    (tokenizers-backed) tokenizer whose decode adds no clean-up pass, the backend's own decode:
    transformers' Python wrapper around it costs a GPU step's host time at 64 sequences
    (bench/README.md#detokenizer-backend-decode)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    mro = type(tokenizer).__mro__
    owner = next((k for k in mro if "backend_tokenizer" in vars(k)), None)
    # NOTE: a subclass that overrides decode or _decode is asked itself
    plain = owner is not None and not any(
        "decode" in vars(k) or "_decode" in vars(k) for k in mro[: mro.index(owner)])
    if backend is not None and plain:
        cleanup = getattr(tokenizer, "clean_up_tokenization_spaces", False)
        bpe_skips = type(backend.model).__name__ == "BPE" and not getattr(
            tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
        if not cleanup or bpe_skips:
            return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    """Decodes a window of recent tokens and emits only text that is complete.

    `prefix` .. `read` is the window already turned into text; decoding prefix.. with the new
    tokens and removing the window's text gives the new text. A trailing U+FFFD means the last
    token ends inside a multi-byte character: nothing is emitted until it completes.
    """

    def __init__(self, tokenizer, prompt_ids: list[int]):
        self._decode = text_decoder(tokenizer)
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix = 0
        self.read = len(self.ids)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]

    def flush(self) -> str:
        """At the end: whatever is left, a trailing incomplete character (as U+FFFD) included."""
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return after[len(before) :]


class StopMatcher:
    """Finds stop strings in generated text and holds back a tail that may still become one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""  # all generated text, stop string excluded once found
        self.hit = False
        self.released = 0  # characters of `text` already handed out

    def feed(self, delta: str, match: bool = True) -> bool:
        """Append text; True when a stop string appeared (text is cut before it). `match`
        false (before min_tokens): appended, not searched."""
        start = max(0, len(self.text) - self.hold)
        self.text += delta
        if not match:
            return False
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.hit = True
            return True
        return False

    def release(self, upto: int, final: bool) -> str:
        """Text up to `upto` that is safe to send now; everything when `final`."""
        end = len(self.text) if final else min(upto, len(self.text) - self.hold)
        end = max(end, self.released)
        out = self.text[self.released : end]
        self.released = end
        return out
