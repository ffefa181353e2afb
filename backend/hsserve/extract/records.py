"""Dataset records: one JSON object a line, {"text": ...}, {"input_ids": [...]} or
{"messages": [...]} (rendered with the model's chat template), with an optional "id"."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class Record:
    line: int  # 0-based line number in the file
    id: str
    input_ids: list[int]


@dataclass(frozen=True)
class BadRecord:
    line: int
    reason: str


def read_records(path: str, tokenizer, max_tokens: int) -> Iterator[Record | BadRecord]:
    """Each line as a Record (tokenized here, so that every row's token is known), or a
    BadRecord saying why it cannot be one."""
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                yield BadRecord(i, "empty line")
                continue
            try:
                yield _record(i, json.loads(line), tokenizer, max_tokens)
            except (ValueError, TypeError, KeyError) as e:
                yield BadRecord(i, str(e) or type(e).__name__)


def _record(i: int, obj, tokenizer, max_tokens: int) -> Record:
    if not isinstance(obj, dict):
        raise ValueError("a record must be a JSON object")
    given = [k for k in ("text", "input_ids", "messages") if k in obj]
    if len(given) != 1:
        raise ValueError("give exactly one of text, input_ids or messages")
    rid = str(obj.get("id", i))
    if given[0] == "input_ids":
        ids = obj["input_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise ValueError("input_ids must be a list of token ids")
    elif tokenizer is None:
        raise ValueError(f"{given[0]} needs a tokenizer (--model)")
    elif given[0] == "text":
        if not isinstance(obj["text"], str):
            raise ValueError("text must be a string")
        ids = list(tokenizer(obj["text"]).input_ids)
    else:
        ids = list(tokenizer.apply_chat_template(obj["messages"], tokenize=True,
                                                 add_generation_prompt=max_tokens > 0,
                                                 return_dict=False))
    if not ids:
        raise ValueError("the prompt is empty")
    return Record(i, rid, [int(t) for t in ids])
