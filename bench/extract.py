"""`hsserve extract` throughput: MODE=full rows of 3 layers for prompts of 512 tokens, through the
real tritonserver against the engine in this process (--local), taking turns. The server's rows
come in the gRPC messages (FP32, and BF16 from a copy of `llm` declaring HIDDEN_STATES TYPE_BF16)
or through system shared memory (--transport shm).

    .venv/bin/python bench/extract.py          # -> results/extract_cpu.json
    python3 bench/extract.py --shape llama-8b  # GPU: random bf16 weights, layers 2 16 29, bf16
                                               # rows -> results/h200_extract_8b.json

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
from shapes import random_model  # noqa: E402
from triton_stream_vs_direct import set_params  # noqa: E402

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


def bf16_repository(root: str, params: dict[str, str] | None = None) -> str:
    """model_repository plus `llm_bf16`: llm with its rows in bfloat16 on the wire; params set
    on both (the GPU shape's)."""
    repo = os.path.join(root, "model_repository")
    shutil.copytree(REPO, repo, ignore=shutil.ignore_patterns("__pycache__"))
    if params:  # NOTE: before llm_bf16 copies llm
        set_params(os.path.join(repo, "llm", "config.pbtxt"), params)
    cfg = os.path.join(repo, "llm_bf16", "config.pbtxt")
    shutil.copytree(os.path.join(repo, "llm"), os.path.dirname(cfg))
    with open(cfg) as f:
        text = f.read().replace('name: "llm"', 'name: "llm_bf16"').replace(
            'name: "HIDDEN_STATES", data_type: TYPE_FP32', 'name: "HIDDEN_STATES", data_type: TYPE_BF16')
    with open(cfg, "w") as f:
        f.write(text)
    return repo


def host_copy_gb_s() -> float:
    """Device-to-pinned-host copy bandwidth (GB/s) of 1 GiB: what rows leaving the GPU can reach."""
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    dst.copy_(src)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * src.numel() * 2 / (time.perf_counter() - t) / 1e9


def setting(shape: str) -> dict:
    """What the run extracts and with which engine: SmolLM2 fp32 on the CPU, or a GPU shape."""
    if not shape:
        return dict(layers=["0", "15", "-1"], model="default", label="SmolLM2-135M fp32",
                    engine=EngineConfig(device="cpu"), params=None)
    folder = random_model(shape)
    # NOTE: a short context bounds each engine's KV pool: the server's and this process's share
    # the GPU
    params = dict(model=folder, device="cuda", load_format="dummy", dtype="bfloat16",
                  hidden_layers_captured="2 16 29", max_model_len="1024")
    engine = EngineConfig(model=folder, device="cuda", load_format="dummy", dtype="bfloat16",
                          hidden_layers_captured=(2, 16, 29), max_model_len=1024,
                          hidden_dtype="bfloat16")
    return dict(layers=["2", "16", "29"], model=folder, label=f"{shape} random bf16 (GPU)",
                engine=engine, params=params)


def spy(folder: str, seconds: int = 10) -> None:
    """py-spy, in the background, on this process and its children (tritonserver, its stubs and
    their engine processes)."""
    import subprocess

    os.makedirs(folder, exist_ok=True)
    subprocess.Popen(["py-spy", "record", "-p", str(os.getpid()), "-d", str(seconds), "-r", "100",
                      "--subprocesses", "--idle", "--threads", "--nonblocking", "--format", "raw",
                      "-o", os.path.join(folder, "all.txt")],
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=16)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shape", default="", help="GPU: a bench/shapes.py shape, random weights")
    ap.add_argument("--out", default="")
    ap.add_argument("--only", nargs="*", default=None, help="the server ways to run (default: all)")
    ap.add_argument("--spy", default="", help="DIR: py-spy (on PATH) samples this process and the "
                    "server's through the first timed run, into DIR")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    run = setting(args.shape)
    out = args.out or os.path.join(os.path.dirname(__file__), "results", "h200_extract_8b.json"
                                   if args.shape else "extract_cpu.json")
    root = tempfile.mkdtemp()
    data = os.path.join(root, "data.jsonl")
    dataset(data, args.records, args.length, 0)
    common = ["extract", data, "--layers", *run["layers"], "--mode", "full", "--model", run["model"]]
    if args.shape:
        common += ["--dtype", "bfloat16"]
    server = start_server(bf16_repository(root, run["params"]),
                          log_path=os.path.join(root, "server.log"))
    runs: dict[str, list[tuple[float, int, int]]] = {"local": [], "server": [], "server_shm": [],
                                                     "server_bf16": [], "server_bf16_shm": []}
    try:
        server.wait_ready(timeout=600, models=("llm", "llm_bf16"))
        url = ["--url", server.grpc_url, "--admin-key", server.admin_key]
        ways = {"server": url + ["--transport", "grpc"], "server_shm": url + ["--transport", "shm"]}
        ways["server_bf16"] = ways["server"] + ["--triton-model", "llm_bf16", "--dtype", "bfloat16"]
        ways["server_bf16_shm"] = ways["server_shm"] + ["--triton-model", "llm_bf16",
                                                        "--dtype", "bfloat16"]
        ways = {k: v for k, v in ways.items() if args.only is None or k in args.only}
        for name, way in ways.items():
            timed(common + way, os.path.join(root, "warm"))
        engine = Engine(run["engine"]).start()
        timed(common, os.path.join(root, "warm-local"), engine)
        if args.spy:
            spy(args.spy)
        for _ in range(args.repeats):  # NOTE: taking turns
            for name, way in ways.items():
                runs[name].append(timed(common + way, os.path.join(root, "s")))
            runs["local"].append(timed(common, os.path.join(root, "l"), engine))
        engine.shutdown()
    finally:
        server.stop()
    rows = {}
    for name, rs in ((k, v) for k, v in runs.items() if v):
        rows[name] = {"tokens_s": round(statistics.median(t / d for d, t, _ in rs), 1),
                      "mb_s": round(statistics.median(b / d / 1e6 for d, _, b in rs), 1)}
    for name in ways:
        rows[f"{name}_vs_local"] = round(rows[name]["tokens_s"] / rows["local"]["tokens_s"], 3)
    if args.shape:
        rows["host_copy_gb_s"] = round(host_copy_gb_s(), 1)
    write_result(out, {"benchmark": "extract_full_3_layers", "model": run["label"],
                       "records": args.records, "prompt_tokens": args.length,
                       "layers": [int(k) for k in run["layers"]], **rows})
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
