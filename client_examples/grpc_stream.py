"""Stream a generation over gRPC, printing text as it arrives, then the hidden-state shape.

    python client_examples/grpc_stream.py "Tell me about Paris" --max-tokens 64 --mode last
"""

from __future__ import annotations

import argparse
import queue
import sys

import numpy as np
import tritonclient.grpc as grpcclient


def make_input(name: str, values, dtype) -> grpcclient.InferInput:
    arr = np.array(values, dtype=dtype)
    inp = grpcclient.InferInput(name, list(arr.shape), {np.object_: "BYTES", np.int32: "INT32",
                                                      np.bool_: "BOOL", np.float32: "FP32"}[dtype])
    inp.set_data_from_numpy(arr)
    return inp


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("prompt")
    ap.add_argument("--url", default="127.0.0.1:8001")
    ap.add_argument("--model", default="llm")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--mode", default="last", choices=["none", "last", "full"])
    ap.add_argument("--layers", type=int, nargs="+", default=[-1])
    args = ap.parse_args()

    inputs = [
        make_input("text_input", [args.prompt.encode()], np.object_),
        make_input("stream", [True], np.bool_),
        make_input("max_tokens", [args.max_tokens], np.int32),
        make_input("temperature", [args.temperature], np.float32),
        make_input("MODE", [args.mode.encode()], np.object_),
    ]
    if args.mode != "none":  # NOTE: layers without rows are refused
        inputs.append(make_input("hidden_layers", args.layers, np.int32))
    responses: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(args.url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer(args.model, inputs, enable_empty_final_response=True)
    rows = []
    try:
        while True:
            result, error = responses.get(timeout=600)
            if error is not None:
                print(f"\nerror: {error}", file=sys.stderr)
                return 1
            text = result.as_numpy("text_output")
            if text is not None:
                sys.stdout.write(b"".join(text).decode())
                sys.stdout.flush()
            hidden = result.as_numpy("HIDDEN_STATES")
            if hidden is not None:
                rows.append(hidden)
            finish = result.as_numpy("finish_reason")
            if finish is not None:
                print(f"\n[finish_reason={finish[0].decode()} "
                      f"output_tokens={int(result.as_numpy('num_output_tokens')[0])}]")
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()
    if rows:
        print(f"HIDDEN_STATES shape: {tuple(np.concatenate(rows).shape)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
