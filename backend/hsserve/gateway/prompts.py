"""The served model's tokenizer in the gateway: prompts to token ids exactly as the engine
tokenizes text_input (so usage, echo and prompt logprobs line up), the chat template, and each
token's text for logprobs."""

from __future__ import annotations

import functools
import os
import re

from hsserve.gateway.errors import invalid


class Prompts:
    def __init__(self, folder: str):
        from hsserve.engine.setup import load_tokenizer

        self.tokenizer = load_tokenizer(folder)
        if self.tokenizer is None:
            raise ValueError(f"{folder}: no tokenizer (tokenizer.json / tokenizer.model)")
        self.token_text = functools.lru_cache(maxsize=1 << 17)(self._token_text)

    def ids(self, prompt: str | tuple[int, ...]) -> list[int]:
        """As the engine's admission tokenizes text_input (the tokenizer's special tokens)."""
        if isinstance(prompt, tuple):
            return list(prompt)
        return list(self.tokenizer(prompt).input_ids)

    def chat_ids(self, messages: tuple[dict, ...]) -> list[int]:
        """The model's chat template with the assistant's turn opened; the template writes the
        special tokens, so none are added again."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise invalid("messages", "this model has no chat template; use /v1/completions")
        try:
            text = self.tokenizer.apply_chat_template(list(messages), tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - the template's own complaint, e.g. role order
            raise invalid("messages", f"the chat template refused them: {e}") from None
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


def model_folder(repository: str, model: str = "llm") -> str:
    """The HF folder `model`'s config.pbtxt serves (its `model` parameter, relative to the
    model's directory; "default": the built-in model, converted once)."""
    cfg = os.path.join(repository, model, "config.pbtxt")
    with open(cfg) as f:
        found = re.search(r'key:\s*"model",\s*value:\s*\{\s*string_value:\s*"([^"]*)"', f.read())
    value = found.group(1) if found else "default"
    if value in ("", "default"):
        from hsserve.models.default_model import ensure_default_model

        return ensure_default_model()
    return value if os.path.isabs(value) else os.path.join(repository, model, value)
