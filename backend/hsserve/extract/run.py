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
from hsserve.extract.shared_memory import admin_key, local_host
from hsserve.extract.sources import Ask, LocalSource, ServerSource
from hsserve.models.eagle3 import default_aux_layers
from hsserve.models.spec import ModelSpec
from hsserve.triton.server import ADMIN_KEY_ENV

log = logging.getLogger("hsserve.extract")


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
    p.add_argument("--transport", choices=["auto", "shm", "grpc"], default="auto",
                   help="--url: rows through system shared memory (needs the admin key and the "
                        "server on this host) or in the gRPC messages; auto: shm when it can")
    p.add_argument("--triton-model", default="llm", help="--url: the served model's name")
    p.add_argument("--admin-key", help=f"the server's admin key (default: ${ADMIN_KEY_ENV})")
    p.add_argument("--shard-mb", type=float, default=512)


def main(args: argparse.Namespace) -> int:
    folder = model_folder(EngineConfig(model=args.model))
    spec = ModelSpec.from_folder(folder)
    layers = default_aux_layers(spec.num_layers) if args.eagle3 else tuple(args.layers)
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
        source = server_source(args, ask, spec.hidden_size * len(layers))
        if source is None:
            return 2
        tokenizer = load_tokenizer(folder)
    try:
        return _extract(args, writer, source, tokenizer)
    finally:
        if engine is not None:
            engine.shutdown()
        else:
            source.close()


def server_source(args, ask: Ask, width: int) -> ServerSource | None:
    """The gRPC source over the transport asked (auto: shared memory when the server is on this
    host and the admin key is known, falling back to the messages if the server refuses)."""
    import tritonclient.grpc as grpcclient

    key = admin_key(args.admin_key)
    shm = args.transport == "shm" or (args.transport == "auto" and key and local_host(args.url))
    if args.transport == "shm" and not key:
        log.error("--transport shm: the server's admin key is needed (--admin-key or $%s)",
                  ADMIN_KEY_ENV)
        return None
    if shm:
        try:
            return ServerSource(args.url, ask, args.concurrency, args.triton_model,
                                shared_memory=key, width=width)
        except grpcclient.InferenceServerException as e:
            if args.transport == "shm":
                log.error("--transport shm: the server refused the shared memory: %s", e.message())
                return None
            log.warning("rows through gRPC: the server refused shared memory (%s)", e.message())
    return ServerSource(args.url, ask, args.concurrency, args.triton_model)


def _extract(args, writer: ShardWriter, source, tokenizer) -> int:
    start = writer.next_line
    progress = Progress(sys.stderr.isatty(), count_lines(args.input) - start)
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


def count_lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


class Progress:
    """Records/s, tokens/s, MB/s and the time left (from `total`, the lines still to read): a line
    redrawn on a terminal, a log line every 10 s otherwise."""

    def __init__(self, tty: bool, total: int = 0):
        self.tty, self.t0, self.last, self.total = tty, time.monotonic(), 0.0, total
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
        seen = self.records + self.skipped
        eta = ""
        if self.total and seen:
            left = max(self.total - seen, 0) * dt / seen
            eta = f", ETA {int(left) // 3600}:{int(left) % 3600 // 60:02d}:{int(left) % 60:02d}"
        return (f"{self.records} records ({self.records / dt:.1f}/s), {self.tokens / dt:.0f} "
                f"tokens/s, {self.bytes / dt / 1e6:.1f} MB/s, {self.skipped} skipped{eta}")

    def summary(self, shards: int) -> None:
        if self.tty:
            sys.stderr.write("\n")
        log.info("done: %s; %.1f MB of rows in %d shards", self.line(), self.bytes / 1e6, shards)
