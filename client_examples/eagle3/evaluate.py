"""Serve held-out prompts with a trained EAGLE-3 head and without: the head's mean accepted length
(tokens a verify step gives), tok/s both ways, and whether the tokens are the same (greedy).

    python client_examples/eagle3/evaluate.py --model TARGET --head HEAD --prompts heldout.jsonl

One request at a time (batch 1, where drafting pays), the engine driven in this process with the
configuration a server takes (speculative_method eagle3, speculative_model HEAD).
"""

from __future__ import annotations

import argparse
import json
import time

from hsserve import Engine, EngineConfig, GenerationRequest, SamplingParams


def serve(engine: Engine, prompts: list[str], max_tokens: int) -> dict:
    steps0, drafted0 = engine.num_steps, engine.stats.draft_tokens
    accepted0, tokens, outputs = engine.stats.accepted_tokens, 0, []
    t0 = time.perf_counter()
    for i, text in enumerate(prompts):
        res = engine.generate(GenerationRequest(
            f"e{i}-{time.monotonic_ns()}", prompt=text,
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0)), timeout=600)
        tokens += len(res.token_ids)
        outputs.append(res.token_ids)
    seconds = time.perf_counter() - t0
    decode_steps = engine.num_steps - steps0 - len(prompts)  # NOTE: a prefill gives the first
    return dict(tokens=tokens, tok_s=round(tokens / seconds, 1),
                mean_accepted_length=round((tokens - len(prompts)) / max(decode_steps, 1), 3),
                drafted=engine.stats.draft_tokens - drafted0,
                accepted=engine.stats.accepted_tokens - accepted0, outputs=outputs)


def evaluate(model: str, head: str, prompts_path: str, max_tokens: int = 96, k: int = 3,
             baseline: bool = True) -> dict:
    """{"eagle3": ..., "none": ... (when baseline), "same_tokens": bool}."""
    with open(prompts_path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    found: dict = {}
    configs = [("eagle3", dict(speculative_method="eagle3", num_speculative_tokens=k,
                               speculative_model=head))] + ([("none", {})] if baseline else [])
    for name, kw in configs:
        engine = Engine(EngineConfig(model=model, device="cpu", max_num_seqs=4, **kw)).start()
        try:
            tok = engine.tokenizer
            texts = [tok.apply_chat_template(r["messages"], tokenize=False,
                                             add_generation_prompt=True) for r in records]
            serve(engine, texts[:1], 8)  # NOTE: warm-up
            found[name] = serve(engine, texts, max_tokens)
        finally:
            engine.shutdown()
    if baseline:
        found["same_tokens"] = found["eagle3"]["outputs"] == found["none"]["outputs"]
        found["speedup"] = round(found["eagle3"]["tok_s"] / found["none"]["tok_s"], 3)
    for r in found.values():
        if isinstance(r, dict):
            r.pop("outputs")
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--head", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    a = p.parse_args()
    print(json.dumps(evaluate(a.model, a.head, a.prompts, a.max_tokens, a.k), indent=1))


if __name__ == "__main__":
    main()
