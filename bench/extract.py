"""`hsserve extract` throughput: MODE=full rows of 3 layers for prompts of 512 tokens, through the
real tritonserver against the engine in this process (--local), taking turns. The server's rows
come in the gRPC messages (FP32, and BF16 from a copy of `llm` declaring HIDDEN_STATES TYPE_BF16)
or through system shared memory (--transport shm).

    .venv/bin/python bench/extract.py          # -> results/extract_cpu.json

tokens/s = prompt tokens / the extraction's wall time, loading excluded (the server is started
and warmed before; the in-process engine is started once and driven by the same loop the CLI
runs); MB/s = rows' bytes / wall time.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import write_result  # noqa: E402

import torch  # noqa: E402

from hsserve.cli import main as cli  # noqa: E402
from hsserve.engine.config import EngineConfig  # noqa: E402
from hsserve.engine.loop import Engine  # noqa: E402
from hsserve.extract import open_shards  # noqa: E402
from hsserve.extract.run import _extract, add_arguments  # noqa: E402
from hsserve.extract.shards import ShardWriter  # noqa: E402
from hsserve.extract.sources import Ask, LocalSource  # noqa: E402
from hsserve.triton.server import start_server  # noqa: E402

REPO = os.path.join(os.path.dirname(__file__), "..", "model_repository")


def dataset(path: str, records: int, length: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(records):
            f.write(json.dumps({"input_ids": rng.integers(100, 49000, length).tolist()}) + "\n")


def timed(args: list[str], out: str, engine=None) -> tuple[float, int, int]:
    """(seconds, tokens, row bytes) of one extraction into a fresh folder: the CLI, or with
    `engine` the CLI's loop over that engine."""
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    if engine is None:
        assert cli(args + ["--output", out]) == 0
    else:
        local(args, out, engine)
    dt = time.perf_counter() - t
    shards = open_shards(out)
    tokens = sum(len(ids) for ids, _ in shards)
    nbytes = sum(rows.nbytes for _, rows in shards)
    return dt, tokens, nbytes


def local(argv: list[str], out: str, engine) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    a = parser.parse_args(argv[1:] + ["--output", out, "--local"])
    ask = Ask(a.mode, tuple(a.layers), a.max_tokens, getattr(torch, a.dtype))
    writer = ShardWriter.open(out, {"bench": True}, int(a.shard_mb * (1 << 20)))
    assert _extract(a, writer, LocalSource(engine, ask), engine.tokenizer) == 0


def bf16_repository(root: str) -> str:
    """model_repository plus `llm_bf16`: llm with its rows in bfloat16 on the wire."""
    repo = os.path.join(root, "model_repository")
    shutil.copytree(REPO, repo, ignore=shutil.ignore_patterns("__pycache__"))
    cfg = os.path.join(repo, "llm_bf16", "config.pbtxt")
    shutil.copytree(os.path.join(repo, "llm"), os.path.dirname(cfg))
    with open(cfg) as f:
        text = f.read().replace('name: "llm"', 'name: "llm_bf16"').replace(
            'name: "HIDDEN_STATES", data_type: TYPE_FP32', 'name: "HIDDEN_STATES", data_type: TYPE_BF16')
    with open(cfg, "w") as f:
        f.write(text)
    return repo


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=16)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "extract_cpu.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    root = tempfile.mkdtemp()
    data = os.path.join(root, "data.jsonl")
    dataset(data, args.records, args.length, 0)
    common = ["extract", data, "--layers", "0", "15", "-1", "--mode", "full"]
    server = start_server(bf16_repository(root), log_path=os.path.join(root, "server.log"))
    runs: dict[str, list[tuple[float, int, int]]] = {"local": [], "server": [], "server_shm": [],
                                                     "server_bf16": [], "server_bf16_shm": []}
    try:
        server.wait_ready(timeout=600, models=("llm", "llm_bf16"))
        url = ["--url", server.grpc_url, "--admin-key", server.admin_key]
        ways = {"server": url + ["--transport", "grpc"], "server_shm": url + ["--transport", "shm"]}
        ways["server_bf16"] = ways["server"] + ["--triton-model", "llm_bf16", "--dtype", "bfloat16"]
        ways["server_bf16_shm"] = ways["server_shm"] + ["--triton-model", "llm_bf16",
                                                        "--dtype", "bfloat16"]
        for name, way in ways.items():
            timed(common + way, os.path.join(root, "warm"))
        engine = Engine(EngineConfig(device="cpu")).start()
        timed(common, os.path.join(root, "warm-local"), engine)
        for _ in range(args.repeats):  # NOTE: taking turns
            for name, way in ways.items():
                runs[name].append(timed(common + way, os.path.join(root, "s")))
            runs["local"].append(timed(common, os.path.join(root, "l"), engine))
        engine.shutdown()
    finally:
        server.stop()
    rows = {}
    for name, rs in runs.items():
        rows[name] = {"tokens_s": round(statistics.median(t / d for d, t, _ in rs), 1),
                      "mb_s": round(statistics.median(b / d / 1e6 for d, _, b in rs), 1)}
    for name in ways:
        rows[f"{name}_vs_local"] = round(rows[name]["tokens_s"] / rows["local"]["tokens_s"], 3)
    write_result(args.out, {"benchmark": "extract_full_3_layers", "model": "SmolLM2-135M fp32",
                            "records": args.records, "prompt_tokens": args.length,
                            "layers": [0, 15, -1], **rows})
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
