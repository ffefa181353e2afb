"""Load an HF folder (config.json + *.safetensors) into our Decoder, fusing q/k/v and gate/up;
FP8 linears (models/fp8.py) read with their scales, or quantized as they are read."""

from __future__ import annotations

import glob
import logging
import os

import torch
from safetensors import safe_open

from hsserve.models.decoder import Decoder
from hsserve.models.fp8 import FP8, Fp8Scheme, dequantize, quantize, row_scales, scheme_for
from hsserve.models.linear import Linear, pack_for_cpu
from hsserve.models.moe import MoE
from hsserve.models.spec import ModelSpec
from hsserve.models.tensor_parallel import TensorParallel, local_spec, pieces

log = logging.getLogger(__name__)


def resolve_dtype(name: str, spec: ModelSpec, device: torch.device) -> torch.dtype:
    """auto: float32 on CPU; on CUDA the checkpoint's half type, bfloat16 for float32 checkpoints."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.float32
    return torch.float16 if spec.torch_dtype in ("float16", "torch.float16") else torch.bfloat16


# NOTE: per family, a MoE layer's block and its experts' (gate, up, down) tensor names
_EXPERTS = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
            "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"))}


def _mlp_names(spec: ModelSpec, i: int) -> dict[str, list[str]]:
    ours = f"layers.{i}.mlp"
    if not spec.is_moe_layer(i):
        m = f"model.layers.{i}.mlp"
        fused = spec.family == "phi3"  # NOTE: Phi-3's checkpoints hold gate and up as one tensor
        gate_up = [f"{m}.gate_up_proj.weight"] if fused else [f"{m}.gate_proj.weight",
                                                              f"{m}.up_proj.weight"]
        return {f"{ours}.gate_up.weight": gate_up, f"{ours}.down.weight": [f"{m}.down_proj.weight"]}
    block, (gate, up, down) = _EXPERTS[spec.family]
    m = f"model.layers.{i}.{block}"
    experts = range(spec.num_experts)
    return {  # NOTE: stacked [experts, ...] by concatenating on dim 0, then reshaped
        f"{ours}.router": [f"{m}.gate.weight"],
        f"{ours}.gate_up": [f"{m}.experts.{e}.{w}.weight" for e in experts for w in (gate, up)],
        f"{ours}.down": [f"{m}.experts.{e}.{down}.weight" for e in experts],
    }


def _hf_names(spec: ModelSpec, i: int) -> dict[str, list[str]]:
    """Our parameter name -> the HF tensors it is made of (concatenated on dim 0)."""
    a = f"model.layers.{i}.self_attn"
    ours = f"layers.{i}"
    names = {
        f"{ours}.input_norm.weight": [f"model.layers.{i}.input_layernorm.weight"],
        f"{ours}.post_attn_norm.weight": [f"model.layers.{i}.post_attention_layernorm.weight"],
        f"{ours}.attn.qkv.weight": ([f"{a}.qkv_proj.weight"] if spec.family == "phi3" else
                                    [f"{a}.q_proj.weight", f"{a}.k_proj.weight", f"{a}.v_proj.weight"]),
        f"{ours}.attn.o_proj.weight": [f"{a}.o_proj.weight"],
        **_mlp_names(spec, i),
    }
    if spec.qkv_bias:
        names[f"{ours}.attn.qkv.bias"] = [f"{a}.q_proj.bias", f"{a}.k_proj.bias", f"{a}.v_proj.bias"]
    if spec.qk_norm:
        names[f"{ours}.attn.q_norm.weight"] = [f"{a}.q_norm.weight"]
        names[f"{ours}.attn.k_norm.weight"] = [f"{a}.k_norm.weight"]
    if spec.gemma_norms:
        layer = f"model.layers.{i}"
        names[f"{ours}.pre_ff_norm.weight"] = [f"{layer}.pre_feedforward_layernorm.weight"]
        names[f"{ours}.post_ff_norm.weight"] = [f"{layer}.post_feedforward_layernorm.weight"]
    return names


def weight_map(spec: ModelSpec, split_vocab: bool = False) -> dict[str, list[str]]:
    """split_vocab: the lm_head is a shard apart from the (whole) embedding, tied or not."""
    names = {"embed": ["model.embed_tokens.weight"], "norm.weight": ["model.norm.weight"]}
    if not spec.tie_word_embeddings:
        names["lm_head.weight"] = ["lm_head.weight"]
    elif split_vocab:
        names["lm_head.weight"] = ["model.embed_tokens.weight"]
    for i in range(spec.num_layers):
        names.update(_hf_names(spec, i))
    return names


def build_decoder(spec: ModelSpec, dtype: torch.dtype, device: torch.device,
                  parallel: TensorParallel | None = None, fp8: bool = False) -> Decoder:
    """An uninitialized decoder on `device` (weights are filled by load_weights or random_weights);
    with `parallel`, the shard of that rank (spec: the whole model's); fp8: float8 linears."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # NOTE: restored below; inv_freq stays float32 explicitly
    try:
        with torch.device(device):
            model = Decoder(local_spec(spec, parallel.size, parallel.rank) if parallel else spec,
                            parallel, fp8)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


class _Checkpoint:
    """The folder's safetensors files, each tensor found by name (opened once, closed after)."""

    def __init__(self, folder: str):
        files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {folder}")
        self.folder, self.where, self.handles = folder, {}, {}
        for path in files:
            with safe_open(path, framework="pt") as f:
                self.where.update({k: path for k in f.keys()})

    def require(self, names: list[str]) -> None:
        missing = [t for t in names if t not in self.where]
        if missing:
            raise KeyError(f"checkpoint {self.folder} lacks {missing}")

    def handle(self, name: str):
        self.require([name])
        path = self.where[name]
        if path not in self.handles:
            self.handles[path] = safe_open(path, framework="pt")
        return self.handles[path]

    def read(self, name: str, dim: int = 0, s: slice = slice(None)) -> torch.Tensor:
        """Only the slice a rank holds is read from the file."""
        if s == slice(None):
            return self.handle(name).get_tensor(name)
        part = self.handle(name).get_slice(name)
        return part[s] if dim == 0 else part[:, s]

    def fp8_part(self, name: str, dim: int, s: slice, scheme: Fp8Scheme):
        """(W8 slice, its row scales, its static input scale or None) of one linear: the
        checkpoint's, or quantized here (whole rows first: a row's scale is its amax)."""
        if not scheme.in_checkpoint:
            w8, scale = quantize(self.read(name))
            w8 = w8 if s == slice(None) else (w8[s] if dim == 0 else w8[:, s])
            return w8, scale[s] if dim == 0 else scale, None
        w8 = self.read(name, dim, s)
        if w8.dtype != FP8:
            raise ValueError(f"{name}: {w8.dtype} in a checkpoint whose quantization_config "
                             "says float8 weights")
        rows = self.handle(name).get_slice(name).get_shape()[0]
        scale = row_scales(self.read(name + "_scale"), rows)
        xs = (self.read(name.removesuffix("weight") + "input_scale").reshape(-1)[:1]
              if scheme.activations == "tensor" else None)
        return w8, scale[s] if dim == 0 else scale, xs


_LINEARS = (".qkv.weight", ".o_proj.weight", ".gate_up.weight", ".down.weight")
_EXPERT_PARAMS = ("mlp.gate_up", "mlp.down")


def load_weights(model: Decoder, folder: str, spec: ModelSpec | None = None,
                 scheme: Fp8Scheme | None = None) -> None:
    """spec: the whole model's (model.spec is a rank's shard under tensor parallelism);
    scheme: the linears are float8 (a checkpoint's, or quantized at load)."""
    spec = spec or model.spec
    tp = model.parallel
    size, rank = (tp.size, tp.rank) if tp is not None else (1, 0)
    ckpt = _Checkpoint(folder)
    params = dict(model.named_parameters())
    try:
        for ours, theirs in weight_map(spec, split_vocab=size > 1).items():
            ckpt.require(theirs)
            reads = [(theirs[i], dim, s) for i, dim, s in pieces(spec, size, rank, ours,
                                                                  len(theirs))]
            if scheme is not None and ours.endswith(_LINEARS + _EXPERT_PARAMS):
                _check_ignored(scheme, theirs)
                parts = [ckpt.fp8_part(name, dim, s, scheme) for name, dim, s in reads]
                _fill_fp8(model, ours, params[ours], parts, scheme)
                continue
            parts = [ckpt.read(name, dim, s) for name, dim, s in reads]
            _fill(params[ours], torch.cat(parts, dim=0) if len(parts) > 1 else parts[0])
    finally:
        ckpt.handles.clear()


def _check_ignored(scheme: Fp8Scheme, theirs: list[str]) -> None:
    for name in theirs:
        if scheme.ignores(name.removesuffix(".weight")):
            raise ValueError(f"quantization_config.ignore: leaves {name} unquantized; only "
                             "lm_head and the MoE routers may be")


def _fill_fp8(model: Decoder, ours: str, param: torch.Tensor, parts, scheme: Fp8Scheme) -> None:
    """One linear (or a layer's stacked experts) from its float8 parts: kept as W8 and scales
    where the Linear holds float8, else dequantized; its input quantization as the scheme says."""
    w8 = torch.cat([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
    scale = torch.cat([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
    if ours.endswith(_EXPERT_PARAMS):  # NOTE: as transformers dequantizes experts: through bfloat16
        _fill(param, (w8.float() * scale.float()[:, None]).to(torch.bfloat16))
        return  # NOTE: and, there as here, their inputs are not quantized
    linear = model.get_submodule(ours.removesuffix(".weight"))
    assert isinstance(linear, Linear)
    if linear.weight_scale is not None:
        _fill(param, w8)
        linear.weight_scale.copy_(scale.float())
    else:
        _fill(param, dequantize(w8, scale, param.dtype))
    if scheme.activations is not None:
        linear.quantize_inputs = True
        if scheme.activations == "tensor":  # NOTE: fused parts read one input: their max
            xs = torch.stack([p[2].float() for p in parts]).amax().reshape(1)
            linear.input_scale = xs.to(param.device)


def _fill(target: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy into the parameter; a last vocabulary shard's missing rows are zeros."""
    if whole.numel() < target.numel():
        target.data.zero_()
        target.data.view(-1)[: whole.numel()].copy_(whole.reshape(-1))
    else:
        target.data.copy_(whole.view(target.shape))


def random_weights(model: Decoder, seed: int = 0, std: float = 0.02,
                   quantize_inputs: bool = False) -> None:
    """Random weights in the model's real shapes (benchmarks: speed does not depend on values);
    float8 linears quantized from them (and their inputs per token where asked)."""
    gen = torch.Generator(device=model.embed.device).manual_seed(seed)
    for m in model.modules():
        if isinstance(m, Linear) and m.weight_scale is not None:
            w = torch.empty(m.weight.shape, dtype=torch.bfloat16, device=m.weight.device)
            w8, scale = quantize(w.normal_(0.0, std, generator=gen))
            m.weight.data.copy_(w8)
            m.weight_scale.copy_(scale)
            m.quantize_inputs = quantize_inputs
    for name, p in model.named_parameters():
        if p.dtype == FP8:
            continue
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        else:
            p.data.normal_(0.0, std, generator=gen)


def load_model(folder: str, dtype_name: str, device: torch.device, load_format: str = "auto",
               parallel: TensorParallel | None = None, quantization: str = "none") -> Decoder:
    """load_format "dummy": random weights in the folder's shapes (only config.json is read);
    with `parallel`, this rank's shard. quantization "fp8": a plain checkpoint's linears
    quantized at load (a float8 checkpoint is read as it is, whatever this says)."""
    spec = ModelSpec.from_folder(folder)
    scheme = scheme_for(folder, quantization)
    fp8 = scheme is not None and device.type == "cuda"  # NOTE: the CPU dequantizes at load
    model = build_decoder(spec, resolve_dtype(dtype_name, spec, device), device, parallel, fp8)
    if load_format == "dummy":
        random_weights(model, quantize_inputs=scheme is not None and scheme.activations == "token")
    else:
        load_weights(model, folder, spec, scheme)
        if spec.gemma_norms:
            plus_one_norms(model)
    for m in model.modules():
        if isinstance(m, MoE):
            m.prepare()
    if fold_norms_on(device) and model.fold_norms():
        log.info("norm weights folded into qkv / gate_up")
    if pack_for_cpu(model):
        log.info("CPU linears packed (the compiled product where its library loads, else oneDNN)")
    return model


@torch.no_grad()
def plus_one_norms(model: Decoder) -> None:
    """Gemma's norms scale by (1 + w): stored so, our RMSNorm scales by its weight (exact in
    float32; a half-precision weight rounds 1 + w once)."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_((p.float() + 1.0).to(p.dtype))


def fold_norms_on(device: torch.device) -> bool:
    """Where the layers run with their norms folded (Decoder.fold_norms): on CUDA, where it saves
    two kernel launches per layer; the CPU keeps the plain layers."""
    return device.type == "cuda"
