"""On CUDA (pytest -m gpu): every family's tiny random model equals transformers (Issue 29).

Issue 29 on CUDA (pytest -m gpu): every family's tiny random model (tests/conftest.py) against
transformers in float32. float32: greedy tokens equal and rows within 1e-3 of the row norm;
bfloat16: each row of our own tokens with cosine >= 0.999 (MoE through the grouped GEMM and its
decode graphs; Gemma 2 through the torch attention)."""

from __future__ import annotations

import copy

import pytest
import torch

from tiny_models import tiny_config
from hsserve import Engine, EngineConfig, GenerationRequest, HiddenStatesMode, SamplingParams
from oracle import hf_greedy, hf_hidden, max_rel_row_diff

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FAMILIES = ("phi3", "gemma2", "gemma3", "mixtral", "qwen3_moe")
LAYERS = (0, 1, -1)


@pytest.fixture(scope="module")
def family_model(tmp_path_factory):
    """family -> (folder, transformers float32 model); no tokenizer (token ids only)."""
    from transformers import AutoModelForCausalLM

    def make(family, conditioned=False):
        """conditioned: the usual init (the CPU tests' larger weights peak the attention, which
        bf16 rounding then moves) and routers scaled 20x (no expert choice a rounding can flip)."""
        cfg = tiny_config(family)
        if conditioned:
            cfg.initializer_range = 0.02
        torch.manual_seed(1234)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        if conditioned:
            experts = getattr(cfg, "num_local_experts", getattr(cfg, "num_experts", -1))
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith("gate.weight") and p.shape[0] == experts:
                        p.mul_(20.0)
        folder = str(tmp_path_factory.mktemp(f"gpu-{family}"))
        model.save_pretrained(folder)
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                  attn_implementation="eager").eval()
        return folder, hf

    return make


def run(folder, dtype, prompts):
    engine = Engine(EngineConfig(model=folder, device="cuda", dtype=dtype, max_num_seqs=8,
                                 max_model_len=256)).start()
    try:
        graphs = engine.num_graph_captures
        streams = [engine.submit(GenerationRequest(
            f"f{i}", prompt_ids=p, sampling=SamplingParams(max_tokens=10, temperature=0.0),
            hidden_mode=HiddenStatesMode.FULL, hidden_layers=LAYERS)) for i, p in enumerate(prompts)]
        return [s.result(timeout=300) for s in streams], graphs
    finally:
        engine.shutdown()


def _routes(model, seq: list[int], k: int) -> list[torch.Tensor]:
    """Per MoE layer, each token's chosen experts (sorted) in a transformers forward."""
    chosen = []

    def hook(_module, _inp, out):
        logits = (out[0] if isinstance(out, tuple) else out).float()
        top = logits.reshape(-1, logits.shape[-1]).topk(k, dim=-1).indices
        chosen.append(top.sort(dim=-1).values)

    handles = [m.register_forward_hook(hook) for n, m in model.named_modules()
               if n.endswith("mlp.gate")]
    try:
        with torch.no_grad():
            model(torch.tensor([seq]))
    finally:
        for h in handles:
            h.remove()
    return chosen


def stable_prefix(hf, seq: list[int]) -> int:
    """Tokens before the first one that transformers' own bfloat16 run routes to other experts
    than its float32 run (len(seq) if none): after it, bfloat16 rows may differ for a real reason
    (82d444c: Mixtral's 2nd / 3rd experts at 0.1928 / 0.1920 gave a row at cosine 0.998, the same
    on CPU and GPU)."""
    k = getattr(hf.config, "num_experts_per_tok", 0)
    if not k:
        return len(seq)
    half = copy.deepcopy(hf).to(torch.bfloat16)
    first = len(seq)
    for a, b in zip(_routes(hf, seq, k), _routes(half, seq, k)):
        differ = (a != b).any(dim=-1).nonzero()
        if len(differ):
            first = min(first, int(differ[0]))
    return first


@pytest.mark.parametrize("family", FAMILIES)
def test_family_on_cuda(family, family_model):
    folder, hf = family_model(family)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 40000, (n,), generator=g).tolist() for n in (1, 9, 30, 70)]
    results, graphs = run(folder, "float32", prompts)
    assert graphs > 0  # NOTE: MoE and Gemma 2 decode through the graphs too
    for p, r in zip(prompts, results):
        assert r.token_ids == hf_greedy(hf, p, 10, 2)
        ref = hf_hidden(hf, p + r.token_ids, LAYERS)
        assert max_rel_row_diff(r.hidden, ref, len(LAYERS)) <= 1e-3
    folder, hf = family_model(family, conditioned=True)
    compared = 0
    for p, r in zip(prompts, run(folder, "bfloat16", prompts)[0]):
        rows = stable_prefix(hf, p + r.token_ids)
        compared += rows
        ref = hf_hidden(hf, p + r.token_ids, LAYERS)[:rows]
        for ours, theirs in zip(r.hidden[:rows].float().chunk(3, -1), ref.chunk(3, -1)):
            cos = torch.nn.functional.cosine_similarity(ours, theirs, dim=-1)
            assert float(cos.min()) >= 0.999, (family, float(cos.min()))
    assert compared >= 60, compared  # NOTE: of 149 rows: most are compared
