"""hsserve extract, in process and through the server, writes transformers' rows and resumes.

Issue 26: `hsserve extract` over a small dataset (text, input_ids, messages, a bad line),
through the engine in process and through the real server: rows equal transformers'
hidden_states, resume after a kill gives the same bytes, shards read by open_shards and by plain
safetensors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from oracle import hf_hidden, max_rel_row_diff
from safetensors.torch import load_file

from hsserve.cli import main as cli
from hsserve.extract import open_shards

RECORDS = [{"text": "The capital of France is", "id": "paris"}, {"input_ids": [504, 3458, 282]},
           "not json", {"messages": [{"role": "user", "content": "Name a prime number."}]},
           {"text": ""}, {"input_ids": [5, 10**6]}]  # NOTE: the last refused by the engine
RECORDS += [{"text": f"Fact number {i}: water boils at"} for i in range(6)]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("extract") / "data.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in RECORDS))
    return str(path)


def extract(dataset, out, *extra):
    return cli(["extract", dataset, "--output", str(out), "--layers", "0", "15", "-1", *extra])


def records(folder):
    s = open_shards(str(folder), framework="torch")
    return s.record_ids, [(ids.tolist(), rows) for ids, rows in s]


@pytest.mark.parametrize("max_tokens", ["0", "3"])
def test_local_rows_equal_transformers(dataset, tmp_path, hf_model, smollm_dir, max_tokens):
    assert extract(dataset, tmp_path, "--local", "--max-tokens", max_tokens) == 0
    ids, recs = records(tmp_path)
    assert ids == ["paris", "1", "3"] + [str(i) for i in range(6, 12)], "bad lines skipped"
    hf = hf_model(smollm_dir)
    for tokens, rows in recs:
        assert rows.shape == (len(tokens), 3 * 576)
        assert max_rel_row_diff(rows, hf_hidden(hf, tokens, (0, 15, -1)), 3) <= 1e-3
    plain = load_file(str(tmp_path / "shard-00000.safetensors"))
    assert plain["offsets"][0] == 0 and plain["input_ids"].dtype == torch.int32
    assert int(plain["offsets"][-1]) == plain["hidden_states"].shape[0]


def test_eagle3_layers():
    from hsserve.models.eagle3 import default_aux_layers as eagle3_layers

    assert eagle3_layers(32) == (2, 16, 29) and eagle3_layers(30) == (2, 15, 27)


def test_server_equals_local(dataset, tmp_path, triton_server):
    local, served = tmp_path / "local", tmp_path / "served"
    assert extract(dataset, local, "--local", "--max-tokens", "2") == 0
    assert extract(dataset, served, "--url", triton_server.grpc_url, "--max-tokens", "2",
                   "--concurrency", "4") == 0
    a, b = records(local), records(served)
    assert a[0] == b[0]
    for (ta, ra), (tb, rb) in zip(a[1], b[1]):
        assert ta == tb and torch.allclose(ra, rb, rtol=0, atol=1e-4)


@pytest.mark.parametrize("model, mode", [("llm", "full"), ("llm_capped", "last")])
def test_shared_memory_rows_equal_the_grpc_ones(dataset, tmp_path, triton_server, model, mode):
    """Rows through system shared memory (llm: FP32 on the wire; llm_capped: BF16) are the
    bytes the gRPC messages carry (one request at a time, the prefix cache warm for both: the
    same batches, the same bits); without the admin key, or with a wrong one, refused."""
    common = ["--url", triton_server.grpc_url, "--max-tokens", "2", "--concurrency", "1",
              "--mode", mode, "--triton-model", model, "--dtype", "bfloat16"]
    key = ["--admin-key", triton_server.admin_key]
    # NOTE: a cached prompt's last token runs as a one-row chunk (the CPU's decode kernel), not
    # inside the prompt's prefill: last bits differ from a cold run, so both runs are warm
    assert extract(dataset, tmp_path / "warm", *common, "--transport", "grpc") == 0
    assert extract(dataset, tmp_path / "grpc", *common, "--transport", "grpc") == 0
    assert extract(dataset, tmp_path / "shm", *common, "--transport", "shm", *key) == 0
    a, b = records(tmp_path / "grpc"), records(tmp_path / "shm")
    assert a[0] == b[0] and len(a[1]) == 9  # NOTE: 12 records, 3 refused
    for (ta, ra), (tb, rb) in zip(a[1], b[1]):
        assert ta == tb and ra.dtype == torch.bfloat16 and torch.equal(ra, rb)
    assert extract(dataset, tmp_path / "nokey", *common, "--transport", "shm") == 2
    assert extract(dataset, tmp_path / "bad", *common, "--transport", "shm",
                   "--admin-key", "wrong") == 2
    # auto with the key on this host: shared memory; the same bytes again
    assert extract(dataset, tmp_path / "auto", *common, *key) == 0
    assert records(tmp_path / "auto")[1][0][1].equal(b[1][0][1])


def test_a_killed_run_resumes_to_the_same_bytes(dataset, tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    # NOTE: a shard per record; one record at a time: batches of other sizes change the rows'
    # last bits, so only runs of the same batches are byte-identical
    small = ["--local", "--max-tokens", "2", "--shard-mb", "0.05", "--concurrency", "1"]
    assert extract(dataset, whole, *small) == 0
    cmd = [sys.executable, "-m", "hsserve.cli", "extract", dataset, "--output", str(killed),
           "--layers", "0", "15", "-1", *small]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    index = killed / "index.json"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if index.exists() and len(json.loads(index.read_text())["shards"]) >= 3:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len(json.loads(index.read_text())["shards"])
    assert 3 <= done < len(os.listdir(whole)) - 1, "killed in the middle"
    assert extract(dataset, killed, *small) == 0
    names = sorted(f for f in os.listdir(whole) if f.endswith(".safetensors"))
    assert names == sorted(f for f in os.listdir(killed) if f.endswith(".safetensors"))
    for f in names:
        assert (whole / f).read_bytes() == (killed / f).read_bytes(), f
    assert extract(dataset, killed, "--local", "--layers", "-1") == 2, "other arguments refused"


def test_progress_line_gives_the_time_left():
    from hsserve.extract.run import Progress

    p = Progress(tty=False, total=10)
    p.t0 -= 8.0  # NOTE: 8 s in, 4 of 10 lines seen: 12 s left
    for _ in range(3):
        p.done(100, 1 << 20)
    p.skip(7, "bad json")
    line = p.line()
    assert "3 records" in line and "1 skipped" in line and "ETA 0:00:12" in line
