"""Where a batch-1 decode step goes when a kernel profiler cannot say (under PDL a kernel's span
includes its wait on the one before): one engine, its decode graph recaptured with a part of each
layer left out, each replay timed by CUDA events (best of 3 x 100 replays). Random weights in a
real shape; the layers run folded (Decoder.fold_norms: CUDA, bf16).

    python bench/gpu_ablation.py [--shape qwen3-30b-a3b] [--out FILE]

Variants: full; attention_only (the MLP or experts left out); mlp_only (attention left out);
no_attention_kernel (q passed through as attention's output: the products, rotary and cache
writes stay); no_layers (embedding, lm_head, argmax). A difference of two is what the left-out
part costs in the chain, its overlap with the rest included. Default --out:
bench/results/h200_ablation_<shape>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from common import event_ms, write_result  # noqa: E402
from gpu_decode import engine_run, make_engine  # noqa: E402
from shapes import SHAPES, random_model  # noqa: E402

import hsserve.models.decoder as decoder  # noqa: E402

LAYER, ATTEND = decoder.DecoderLayer.forward_folded, decoder.attend


def _attention_only(layer, stream, rope, batch, kv):
    return layer.attn(stream, rope, batch, kv, folded_eps=layer.input_norm.eps)


def _mlp_only(layer, stream, rope, batch, kv):
    return layer.mlp(stream, folded_eps=layer.post_attn_norm.eps)


VARIANTS = {
    "full": (LAYER, ATTEND),
    "attention_only": (_attention_only, ATTEND),
    "mlp_only": (_mlp_only, ATTEND),
    "no_attention_kernel": (LAYER, lambda q, *_a, **_k: q),
    "no_layers": (lambda _layer, stream, *_a: stream, ATTEND),
}


def replay_us(engine, variant: str) -> float:
    """The batch-1 decode graph recaptured with the variant's layer and attention, us a replay."""
    decoder.DecoderLayer.forward_folded, decoder.attend = VARIANTS[variant]
    try:
        graphs = engine.executor.graphs
        graphs.capture()
        graph = graphs.graphs[(1, False)]
        return 1000 * min(event_ms(graph.replay, 100) for _ in range(3))
    finally:
        decoder.DecoderLayer.forward_folded, decoder.attend = LAYER, ATTEND


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    engine = make_engine(random_model(args.shape), 1)
    try:
        assert engine.executor.model.folded, "the ablation patches the folded layers"
        engine_run(engine, 1, tag="warm")  # NOTE: real block tables and lengths in the buffers
        rows = {}
        for variant in VARIANTS:
            rows[variant] = round(replay_us(engine, variant), 1)
            print(json.dumps({"variant": variant, "us": rows[variant]}), flush=True)
    finally:
        engine.shutdown()
    layers = SHAPES[args.shape]["num_hidden_layers"]
    base = rows["no_layers"]
    per_layer = {"layer": (rows["full"] - base) / layers,
                 "attention_half": (rows["attention_only"] - base) / layers,
                 "mlp_half": (rows["mlp_only"] - base) / layers,
                 "attention_kernel": (rows["full"] - rows["no_attention_kernel"]) / layers}
    write_result(args.out or os.path.join(os.path.dirname(__file__), "results",
                                          f"h200_ablation_{args.shape}.json"),
                 {"benchmark": "gpu_ablation", "shape": args.shape, "batch": 1,
                  "replay_us": rows, "per_layer_us": {k: round(v, 2) for k, v in per_layer.items()}})


if __name__ == "__main__":
    main()
