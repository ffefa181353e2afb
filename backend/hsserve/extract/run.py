"""The extraction loop: records in file order -> a source (server or local engine) -> shards,
resuming after the last finished shard, bad records reported by line and skipped."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch

from hsserve.engine.config import EngineConfig
from hsserve.engine.setup import load_tokenizer, model_folder
from hsserve.extract.records import BadRecord, read_records
from hsserve.extract.shards import ShardWriter
from hsserve.extract.sources import Ask, LocalSource, ServerSource
from hsserve.models.spec import ModelSpec

log = logging.getLogger("hsserve.extract")


def eagle3_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's low / middle / high: the outputs of layers 2, L/2 and L-3 (hidden_states
    indices; 2, 16, 29 for a 32-layer model)."""
    return (2, num_layers // 2, num_layers - 3)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", help="JSONL: {text | input_ids | messages, id?} per line")
    p.add_argument("--output", required=True, help="folder of shards and index.json")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--layers", type=int, nargs="+", default=[-1],
                       help="hidden_states indices (0 = embeddings, negative from the end)")
    which.add_argument("--eagle3", action="store_true",
                       help="EAGLE-3's low / middle / high layers: 2, L/2, L-3")
    p.add_argument("--mode", choices=["full", "last"], default="full")
    p.add_argument("--max-tokens", type=int, default=0, help="0: the prompt only; N: greedy")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="HOST:PORT of a running tritonserver's gRPC endpoint")
    src.add_argument("--local", action="store_true", help="the engine in this process")
    p.add_argument("--model", default="default", help="model folder (tokenizer; --local: weights)")
    p.add_argument("--device", default="auto", help="--local: auto, cpu, cuda[:N]")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--shard-mb", type=float, default=512)


def main(args: argparse.Namespace) -> int:
    folder = model_folder(EngineConfig(model=args.model))
    spec = ModelSpec.from_folder(folder)
    layers = eagle3_layers(spec.num_layers) if args.eagle3 else tuple(args.layers)
    ask = Ask(args.mode, layers, args.max_tokens, getattr(torch, args.dtype))
    run_args = {"input": os.path.abspath(args.input), "layers": list(layers), "mode": args.mode,
                "max_tokens": args.max_tokens, "dtype": args.dtype, "model": args.model,
                "shard_mb": args.shard_mb}
    try:
        writer = ShardWriter.open(args.output, run_args, int(args.shard_mb * (1 << 20)))
    except ValueError as e:
        log.error("%s", e)
        return 2
    engine = None
    if args.local:
        from hsserve.engine.loop import Engine

        engine = Engine(EngineConfig(model=folder, device=args.device,
                                     hidden_dtype=args.dtype)).start()
        source, tokenizer = LocalSource(engine, ask), engine.tokenizer
    else:
        source, tokenizer = ServerSource(args.url, ask, args.concurrency), load_tokenizer(folder)
    try:
        return _extract(args, writer, source, tokenizer)
    finally:
        if engine is not None:
            engine.shutdown()
        else:
            source.close()


def _extract(args, writer: ShardWriter, source, tokenizer) -> int:
    progress = Progress(sys.stderr.isatty())
    start = writer.next_line
    if start:
        log.info("resuming after %d finished shards (from line %d)", len(writer.shards), start)

    def good_records():
        for r in read_records(args.input, tokenizer, args.max_tokens):
            if r.line < start:
                continue
            if isinstance(r, BadRecord):
                progress.skip(r.line, r.reason)
            else:
                yield r

    for record, result in source.run(good_records(), args.concurrency):
        if isinstance(result, str):
            progress.skip(record.line, result)
            continue
        output_ids, rows = result
        tokens = record.input_ids + output_ids
        row_tokens = tokens if args.mode == "full" else tokens[-1:]
        if len(row_tokens) != len(rows):
            progress.skip(record.line, f"{len(rows)} rows for {len(row_tokens)} tokens")
            continue
        writer.add(record.line, record.id, torch.tensor(row_tokens), rows)
        progress.done(len(tokens), rows.numel() * rows.element_size())
    writer.flush()
    progress.summary(len(writer.shards))
    return 0


class Progress:
    """Records/s, tokens/s, MB/s: a line redrawn on a terminal, a log line every 10 s otherwise."""

    def __init__(self, tty: bool):
        self.tty, self.t0, self.last = tty, time.monotonic(), 0.0
        self.records = self.skipped = self.tokens = self.bytes = 0

    def skip(self, line: int, reason: str) -> None:
        self.skipped += 1
        log.warning("line %d skipped: %s", line + 1, reason)

    def done(self, tokens: int, nbytes: int) -> None:
        self.records, self.tokens, self.bytes = self.records + 1, self.tokens + tokens, \
            self.bytes + nbytes
        now = time.monotonic()
        if self.tty:
            sys.stderr.write(f"\r{self.line()}")
        elif now - self.last >= 10:
            self.last = now
            log.info("%s", self.line())

    def line(self) -> str:
        dt = max(time.monotonic() - self.t0, 1e-9)
        return (f"{self.records} records ({self.records / dt:.1f}/s), {self.tokens / dt:.0f} "
                f"tokens/s, {self.bytes / dt / 1e6:.1f} MB/s, {self.skipped} skipped")

    def summary(self, shards: int) -> None:
        if self.tty:
            sys.stderr.write("\n")
        log.info("done: %s; %.1f MB of rows in %d shards", self.line(), self.bytes / 1e6, shards)
