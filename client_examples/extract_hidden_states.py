"""Hidden states of many prompts into one .npy: one row per prompt (MODE=last, prompt only).

    python client_examples/extract_hidden_states.py prompts.txt out.npy --layers -1 15

Each line of the input file is a prompt. Uses unary infer() on `llm_sync` over gRPC, with
several requests in flight; the output is [num_prompts, hidden_size * len(layers)] float32.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys

import numpy as np
import tritonclient.grpc as grpcclient


def hidden_of(client, model: str, prompt: str, layers: list[int], max_tokens: int) -> np.ndarray:
    def inp(name, arr, dtype):
        i = grpcclient.InferInput(name, list(arr.shape), dtype)
        i.set_data_from_numpy(arr)
        return i

    inputs = [
        inp("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
        inp("max_tokens", np.array([max_tokens], dtype=np.int32), "INT32"),
        inp("MODE", np.array([b"last"], dtype=np.object_), "BYTES"),
        inp("hidden_layers", np.array(layers, dtype=np.int32), "INT32"),
    ]
    result = client.infer(model, inputs)
    return result.as_numpy("HIDDEN_STATES")[0]


def progress(done: int, total: int, width: int = 30) -> None:
    """A one-line progress bar on stderr, redrawn when the percentage moves."""
    if done and done != total and 100 * done // total == 100 * (done - 1) // total:
        return
    filled = width * done // max(total, 1)
    bar = "#" * filled + "." * (width - filled)
    end = "\n" if done == total else ""
    print(f"\r[{bar}] {done}/{total} ({100 * done // max(total, 1)}%)", end=end, file=sys.stderr,
          flush=True)


def extract(url: str, model: str, prompts: list[str], layers: list[int], max_tokens: int = 0,
            concurrency: int = 4) -> np.ndarray:
    """[len(prompts), hidden_size * len(layers)] float32, in prompt order."""
    client = grpcclient.InferenceServerClient(url)
    rows: list[np.ndarray | None] = [None] * len(prompts)
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        futures = {pool.submit(hidden_of, client, model, p, layers, max_tokens): i
                   for i, p in enumerate(prompts)}
        progress(0, len(prompts))
        for done, fut in enumerate(concurrent.futures.as_completed(futures), 1):
            rows[futures[fut]] = fut.result()
            progress(done, len(prompts))
    client.close()
    return np.stack(rows).astype(np.float32)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("prompts", help="text file, one prompt per line")
    ap.add_argument("output", help="where to write the .npy")
    ap.add_argument("--url", default="127.0.0.1:8001")
    ap.add_argument("--model", default="llm_sync")
    ap.add_argument("--layers", type=int, nargs="+", default=[-1])
    ap.add_argument("--max-tokens", type=int, default=0, help="0 = the prompt's own last token")
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()

    with open(args.prompts) as f:
        prompts = [line.rstrip("\n") for line in f if line.strip()]
    out = extract(args.url, args.model, prompts, args.layers, args.max_tokens, args.concurrency)
    np.save(args.output, out)
    print(f"wrote {args.output}: shape {out.shape}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
