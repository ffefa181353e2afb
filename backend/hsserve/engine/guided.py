"""Structured outputs: a request's GuidedDecoding compiled once (xgrammar, cached), one matcher per
completion, and the token bitmask the sampler applies to that row's logits.

The mask touches only what is sampled: logits, log-probabilities (the model's own, before any
processing) and hidden rows are computed as without it. A guided step queued ahead of the previous
one is sampled only once that one is read (its masks follow those tokens:
Executor.finish_sampling); a guided sequence never drafts.
"""

from __future__ import annotations

import json
import logging
import threading

import torch

from hsserve.kernels import cpu_ops
from hsserve.kernels.bitmask import apply_bitmask_triton, bitmask_ref
from hsserve.request import GuidedDecoding, RequestError

log = logging.getLogger(__name__)


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly the given strings."""
    def literal(c: str) -> str:
        return '"' + "".join(ch if ch.isalnum() or ch in " _-.,:;!?()[]{}'/+*=<>@#$%^&|~`"
                             else f"\\u{ord(ch):04x}" if ord(ch) < 0x10000
                             else f"\\U{ord(ch):08x}" for ch in c) + '"'
    return "root ::= " + " | ".join(literal(c) for c in choices)


class Grammars:
    """The compiler over one tokenizer and vocabulary (built at the first guided request)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
        self._tokenizer, self.vocab_size, self._eos = tokenizer, vocab_size, eos_ids
        self._compiler = None
        self._lock = threading.Lock()

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr  # NOTE: only servers that see a guided request load it

                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=list(self._eos) or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
            return self._compiler

    def compile(self, g: GuidedDecoding):
        """The compiled grammar; RequestError naming guided_decoding.<kind> when it is invalid."""
        if self._tokenizer is None:
            raise RequestError("guided_decoding", "this model has no tokenizer")
        comp = self._get_compiler()
        try:
            if g.kind == "json":
                return comp.compile_json_schema(g.value)
            if g.kind == "json_object":  # NOTE: an object, as OpenAI's json_object promises
                return comp.compile_json_schema('{"type": "object"}')
            if g.kind == "regex":
                return comp.compile_regex(g.value)
            if g.kind == "choice":
                return comp.compile_grammar(choice_grammar(json.loads(g.value)))
            return comp.compile_grammar(g.value)
        except (RuntimeError, ValueError) as e:
            # NOTE: xgrammar's message starts with a C++ source location: keep its reason
            reason = str(e).strip().splitlines()[0].split(": ", 1)[-1]
            raise RequestError(f"guided_decoding.{g.kind}", f"cannot be compiled: {reason}") \
                from None

    def matcher(self, g: GuidedDecoding):
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(g))


def fill_bitmask(matchers: list, vocab_size: int, pin: bool = False) -> torch.Tensor | None:
    """Per sampled row its allowed tokens as bits (int32 [rows, ceil(vocab / 32)], -1 = every
    token), or None when no row is guided. pin: in pinned memory (its upload never waits)."""
    if all(m is None for m in matchers):  # NOTE: most steps: nobody guided
        return None
    # NOTE: a terminated matcher: its sequence ended while a step was queued ahead (a void row)
    matchers = [None if m is None or m.is_terminated() else m for m in matchers]
    if all(m is None for m in matchers):
        return None
    words = (vocab_size + 31) // 32
    bitmask = torch.full((len(matchers), words), -1, dtype=torch.int32, pin_memory=pin)
    for i, m in enumerate(matchers):
        if m is not None:
            m.fill_next_token_bitmask(bitmask, i)
    return bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] with the tokens bitmask forbids at -inf (a new tensor, or on CUDA
    the mask kernel's workspace): the CPU or GPU kernel, else the torch reference."""
    if logits.device.type == "cuda" and logits.dtype == torch.float32:
        return apply_bitmask_triton(logits, bitmask.to(logits.device, non_blocking=True))
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous() \
            and cpu_ops.library() is not None:
        return cpu_ops.mask_logits(logits, bitmask.contiguous())
    return bitmask_ref(logits, bitmask)


def advance(matcher, token: int) -> bool:
    """Feed a sampled token; False when the grammar refuses it (then the completion stops)."""
    if matcher.accept_token(token):
        return True
    log.warning("guided decoding: token %d refused by its grammar; the completion stops", token)
    return False
