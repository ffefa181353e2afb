"""Classify text through the llm_classifier ensemble (llm -> hidden_classifier) with one call.

    python client_examples/classify.py "Heavy rain is expected on the coast tonight."
    python client_examples/classify.py "Write a recipe:" --max-tokens 32   # prompt + completion

The client sends only text_input (and max_tokens): the ensemble asks the llm for the MODE=last
hidden state itself. max_tokens=0 (the default here) classifies the prompt alone; with
max_tokens > 0 the row of the last generated token classifies prompt + completion.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import tritonclient.http as httpclient


def classify(url: str, text: str, max_tokens: int, model: str = "llm_classifier") -> dict:
    client = httpclient.InferenceServerClient(url)
    inputs = []
    for name, arr, dtype in (("text_input", np.array([text.encode()], dtype=np.object_), "BYTES"),
                             ("max_tokens", np.array([max_tokens], dtype=np.int32), "INT32")):
        inp = httpclient.InferInput(name, list(arr.shape), dtype)
        inp.set_data_from_numpy(arr)
        inputs.append(inp)
    outputs = [httpclient.InferRequestedOutput(n, binary_data=True)
               for n in ("text_output", "PROBABILITIES", "LABEL")]
    result = client.infer(model, inputs, outputs=outputs)
    client.close()
    text_out = b"".join(result.as_numpy("text_output").reshape(-1)).decode()
    return {
        "label": result.as_numpy("LABEL").reshape(-1)[0].decode(),
        "probabilities": [round(float(p), 4) for p in result.as_numpy("PROBABILITIES").reshape(-1)],
        "completion": text_out,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("text")
    ap.add_argument("--url", default="127.0.0.1:8000", help="HTTP endpoint")
    ap.add_argument("--max-tokens", type=int, default=0)
    args = ap.parse_args()
    print(json.dumps(classify(args.url, args.text, args.max_tokens)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
