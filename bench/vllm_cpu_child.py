"""The vLLM side of cpu_vs_vllm.py, run by the python of vLLM's own virtualenv (never ours).

Loads the model once, warms up, prints `VLLM_READY {versions}`; then for each stdin line (a json
list of prompts, each a list of token ids) generates greedily with EOS ignored and prints
`VLLM_RESULT {tok/s}`, until stdin closes. Imports nothing from hsserve.

    <vllm venv>/bin/python bench/vllm_cpu_child.py MODEL_FOLDER NEW_TOKENS MAX_MODEL_LEN
"""

from __future__ import annotations

import json
import sys
import time


def run(llm, sampling, batch: list[list[int]], new: int) -> float:
    prompts = [{"prompt_token_ids": p} for p in batch]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sampling, use_tqdm=False)
    dt = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == new for o in outs)
    return len(batch) * new / dt


def main() -> None:
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    folder, new, max_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    t0 = time.perf_counter()
    llm = LLM(model=folder, dtype="float32", max_model_len=max_len)
    load_s = time.perf_counter() - t0
    sampling = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    run(llm, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        [[100 + i for i in range(16)]] * 2, 8)
    info = {"vllm": vllm.__version__, "torch": torch.__version__, "load_s": round(load_s, 1)}
    print("VLLM_READY " + json.dumps(info), flush=True)
    for line in sys.stdin:
        print(f"VLLM_RESULT {run(llm, sampling, json.loads(line), new)}", flush=True)


if __name__ == "__main__":
    main()
