"""One request through Triton's HTTP generate endpoint (no client library needed).

    python client_examples/http_generate.py "The capital of France is" --mode last
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("prompt")
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="llm")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--mode", default="last", choices=["none", "last", "full"])
    ap.add_argument("--layers", type=int, nargs="+", default=[-1])
    args = ap.parse_args()

    body = {"text_input": args.prompt, "max_tokens": args.max_tokens, "temperature": 0.0,
            "MODE": args.mode}
    if args.mode != "none":  # NOTE: layers without rows are refused
        body["hidden_layers"] = args.layers
    req = urllib.request.Request(f"{args.url}/v2/models/{args.model}/generate",
                                 data=json.dumps(body).encode(), method="POST")
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
    except urllib.error.HTTPError as e:
        print(f"error {e.code}: {e.read().decode()}", file=sys.stderr)
        return 1
    print(out["text_output"])
    print(f"finish_reason={out['finish_reason']} output_tokens={out['num_output_tokens']}")
    hidden = out.get("HIDDEN_STATES")
    if hidden is not None:
        # NOTE: JSON flattens the [rows, features] tensor
        print(f"HIDDEN_STATES: {len(hidden)} values (first: {hidden[0]:.4f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
