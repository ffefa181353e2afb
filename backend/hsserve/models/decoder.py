"""The decoder forward: one class for the Llama family (Llama, Mistral, Qwen2 bias, Qwen3 q/k norm,
Phi-3; Mixtral and Qwen3-MoE with experts in place of the MLP: models/moe.py; Gemma 2 / 3 with
GemmaLayer's four norms).

Read top to bottom: embed -> layers (attention over the paged cache, MLP) -> final norm. Weights
are plain parameters created uninitialized and filled by the loader; q/k/v and gate/up are fused.

On CUDA the loader folds each layer's two norm weights into the GEMMs that read the normed rows
(Decoder.fold_norms): the layers then pass the residual stream itself, qkv and gate_up read it,
the norm's per-row 1 / rms is applied by the kernel that consumes their output, and o_proj and
down add into the stream in place inside their GEMM: two kernels fewer per layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hsserve.models.attention_batch import AttentionBatch
from hsserve.models.hidden_capture import HiddenCapture
from hsserve.kernels import attend, cpu_ops, store_kv
from hsserve.kernels.elementwise import (add_rmsnorm, embed_rotary, rms_inverse_ref,
                                         rotary_store_, silu_mul)
from hsserve.kernels.gemv import gemv, gemv_fits, gemv_rotary_store, gemv_silu_mul
from hsserve.kernels.gemv_head_norm import gemv_head_norm_store, head_norm_fits
from hsserve.models.linear import Linear
from hsserve.models.moe import MoE
from hsserve.models.rope import Rotary, attention_factor, inverse_frequencies, rotary_for
from hsserve.models.spec import ModelSpec
from hsserve.models.tensor_parallel import TensorParallel


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = _param(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                out64: torch.Tensor | None = None):
        """norm(x), or with a residual (norm(x + residual), x + residual) in one pass on CUDA;
        out64: also given the normed rows in float64 (a router's input: no cast kernel)."""
        normed, total = add_rmsnorm(x, residual, self.weight, self.eps, out64)
        return normed if residual is None else (normed, total)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, index: int = 0, fp8: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
        )
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.qkv = Linear(spec.hidden_size, q_size + 2 * kv_size, bias=spec.qkv_bias, fp8=fp8)
        self.o_proj = Linear(q_size, spec.hidden_size, fp8=fp8)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        # NOTE: gemv_head_norm_store's per-head tickets (zero between launches)
        tickets = torch.zeros(spec.num_heads + 2 * spec.num_kv_heads, dtype=torch.int32)
        self.register_buffer("head_tickets", tickets if spec.qk_norm else None, persistent=False)
        self.scale = (spec.attn_scale or spec.head_dim**-0.5) * attention_factor(spec.rope) ** 2
        self.window = spec.window_of(index)
        # NOTE: Gemma 3's sliding layers rotate with a rope of their own
        self.local_rope = spec.rope_local is not None and self.window is not None
        self.softcap = spec.attn_softcap

    def forward(self, x, rope: Rotary, batch: AttentionBatch, kv, folded_eps: float | None = None):
        """x: the normed rows -> attention output; with folded_eps (the norm's weight folded into
        qkv), x is the residual stream itself, and the attention output is added into it (in
        place: nothing reads the stream's old value after this layer's attention)."""
        h, kvh = self.num_heads, self.num_kv_heads
        stream = x if folded_eps is not None else None
        fused = rope.fused and batch.kernels
        qk = ((self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
              if self.q_norm is not None else None)
        if fused and self.q_norm is None and self.qkv.takes_gemv(x):
            # NOTE: one kernel: the qkv product, rotary, the cache writes
            q = gemv_rotary_store(x, self.qkv.weight, h, kvh, rope.cos, rope.sin, kv,
                                  batch.slot_mapping, folded_eps, scales=self.qkv.fp8_scales())
        elif fused and qk is not None and self.qkv.bias is None and head_norm_fits(
                x, self.qkv.weight, self.head_dim):
            # NOTE: one kernel: the qkv product, then each head's norm, rotary, cache write
            q = gemv_head_norm_store(x, self.qkv.weight, h, kvh, rope.cos, rope.sin, kv,
                                     batch.slot_mapping, qk, self.head_tickets, folded_eps,
                                     scales=self.qkv.fp8_scales())
        else:
            qkv = self.qkv(x).view(len(x), -1, self.head_dim)
            if fused:  # NOTE: one kernel: (q/k norm,) rotary on q and k, the k and v writes
                rotary_store_(qkv, h, kvh, rope.cos, rope.sin, kv, batch.slot_mapping, stream,
                              folded_eps or 0.0, qk_norm=qk)
                q = qkv[:, :h]
            else:
                q = self._rotate_and_store(qkv, rope, batch, kv, stream, folded_eps)
        # NOTE: where layers differ in window, the torch path's masks for the sliding ones
        b = batch.windowed if self.window is not None and batch.windowed is not None else batch
        o = attend(q, kv, b, self.scale, self.window, self.softcap)
        return self.o_proj(o.reshape(len(x), -1), into=stream)

    def _rotate_and_store(self, qkv, rope, batch, kv, stream, folded_eps):
        """The torch path: (1 / rms of the stream,) q/k norm, rotary, the cache writes -> q."""
        h, kvh = self.num_heads, self.num_kv_heads
        if stream is not None:
            qkv = (qkv * rms_inverse_ref(stream, folded_eps)[:, :, None]).to(qkv.dtype)
        if self.q_norm is None and batch.cpu_kernels and qkv.is_contiguous():
            cpu_ops.rotary_store_(qkv, h, kvh, rope.cos, rope.sin, kv, batch.slot_mapping)
            return qkv[:, :h]  # NOTE: one pass: rotary and the cache writes
        if self.q_norm is not None:
            q, k = self.q_norm(qkv[:, :h]), self.k_norm(qkv[:, h : h + kvh])
            q, k = rope.apply(q), rope.apply(k)
        else:  # NOTE: q and k rotated in one pass
            q, k = rope.apply(qkv[:, : h + kvh]).split((h, kvh), dim=1)
        store_kv(kv, k, qkv[:, h + kvh :], batch)
        return q


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, fp8: bool = False):
        super().__init__()
        self.gate_up = Linear(spec.hidden_size, 2 * spec.intermediate_size, fp8=fp8)
        self.down = Linear(spec.intermediate_size, spec.hidden_size, fp8=fp8)
        self.gelu = spec.activation == "gelu_tanh"  # NOTE: Gemma's; the kernels are SiLU's

    def forward(self, x, folded_eps: float | None = None):
        """As Attention.forward: with folded_eps, x is the stream and the MLP output is added
        into it."""
        stream = x if folded_eps is not None else None
        if self.gelu:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return self.down(F.gelu(gate, approximate="tanh") * up)
        if self.gate_up.takes_gemv(x):
            h = gemv_silu_mul(x, self.gate_up.weight, folded_eps,  # NOTE: one kernel
                              scales=self.gate_up.fp8_scales())
        else:
            h = silu_mul(self.gate_up(x), stream, folded_eps or 0.0)
        return self.down(h, into=stream)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, index: int, fp8: bool = False):
        super().__init__()
        self.input_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.attn = Attention(spec, index, fp8)
        self.post_attn_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MoE(spec) if spec.is_moe_layer(index) else MLP(spec, fp8)

    def forward(self, x, residual, rope, batch, kv):
        """x: the previous layer's MLP output (the embeddings for the first layer, residual None).
        Returns (this layer's MLP output, the residual stream before it is added): the add is
        fused into the next norm."""
        if residual is None:
            h, residual = self.input_norm(x), x
        else:
            h, residual = self.input_norm(x, residual)
        h = self.attn(h, rope, batch, kv)
        # NOTE: a BLAS router reads the normed rows in float64: the norm writes them (no cast)
        h64 = self.mlp.router_input_buffer(h) if isinstance(self.mlp, MoE) else None
        h, residual = self.post_attn_norm(h, residual, out64=h64)
        return (self.mlp(h) if h64 is None else self.mlp(h, router_input=h64)), residual

    def forward_folded(self, stream, rope, batch, kv):
        """The same layer with its norms folded (Decoder.fold_norms): stream in, stream out."""
        stream = self.attn(stream, rope, batch, kv, folded_eps=self.input_norm.eps)
        return self.mlp(stream, folded_eps=self.post_attn_norm.eps)


class GemmaLayer(nn.Module):
    """Gemma 3's layer: the attention and MLP outputs are normed before they join the residual
    stream (four norms); the same contract as DecoderLayer."""

    def __init__(self, spec: ModelSpec, index: int, fp8: bool = False):
        super().__init__()
        h, eps = spec.hidden_size, spec.rms_norm_eps
        self.input_norm, self.post_attn_norm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.pre_ff_norm, self.post_ff_norm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.attn = Attention(spec, index, fp8)
        self.mlp = MLP(spec, fp8)

    def forward(self, x, residual, rope, batch, kv):
        if residual is None:
            h, residual = self.input_norm(x), x
        else:
            h, residual = self.input_norm(x, residual)
        h, residual = self.pre_ff_norm(self.post_attn_norm(self.attn(h, rope, batch, kv)), residual)
        return self.post_ff_norm(self.mlp(h)), residual


class Decoder(nn.Module):
    def __init__(self, spec: ModelSpec, parallel: TensorParallel | None = None,
                 fp8: bool = False):
        """parallel: this rank's shard (spec: its shape, models/tensor_parallel.py); fp8: the
        layers' linears hold float8 weights (models/fp8.py; the embedding, lm_head and experts
        stay in the model's dtype)."""
        super().__init__()
        self.spec, self.parallel = spec, parallel
        self.embed = _param(spec.vocab_size, spec.hidden_size)
        layer = GemmaLayer if spec.gemma_norms else DecoderLayer
        self.layers = nn.ModuleList(layer(spec, i, fp8) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        vocab = parallel.vocab_rows(spec.vocab_size) if parallel else spec.vocab_size
        self.lm_head = Linear(spec.hidden_size, vocab)
        if spec.tie_word_embeddings and parallel is None:
            self.lm_head.weight = self.embed  # NOTE: one tensor, loaded once
        for lay in self.layers if parallel else ():  # NOTE: the row-parallel products
            lay.attn.o_proj.reduce = parallel.all_reduce
            lay.attn.o_proj.reduce_max = parallel.all_max
            mlp = lay.mlp
            (mlp if isinstance(mlp, MoE) else mlp.down).reduce = parallel.all_reduce
            if not isinstance(mlp, MoE):
                mlp.down.reduce_max = parallel.all_max
        self.register_buffer(
            "inv_freq", inverse_frequencies(spec.head_dim, spec.rope), persistent=False
        )
        local = spec.rope_local
        self.register_buffer("inv_freq_local", inverse_frequencies(spec.head_dim, local)
                             if local is not None else None, persistent=False)
        # NOTE: Gemma: in the weights' dtype, made once (not per forward)
        self.register_buffer("embed_scale", torch.tensor(spec.embed_scale)
                             if spec.embed_scale != 1.0 else None, persistent=False)
        self.folded = False

    @torch.no_grad()
    def fold_norms(self) -> bool:
        """Multiply each layer's input / post-attention norm weights into the columns of qkv /
        gate_up (experts: MoE.fold_norm; q/k norms come after the scale, rotary_store_), once,
        after loading; False, nothing done, where the layers cannot run folded: a qkv bias (the
        scale must come before it), Gemma's norms, or float16 (the unnormalized stream through a
        GEMM could overflow it), or float8 weights (the product would need new scales)."""
        if self.folded:
            return True  # NOTE: once: a second fold would apply the weights twice
        spec, w = self.spec, self.layers[0].attn.qkv.weight
        if (spec.qkv_bias or spec.gemma_norms or w is None
                or w.dtype in (torch.float16, torch.float8_e4m3fn)):
            return False
        for layer in self.layers:
            layer.attn.qkv.fold_norm(layer.input_norm.weight)
            mlp = layer.mlp
            (mlp if isinstance(mlp, MoE) else mlp.gate_up).fold_norm(layer.post_attn_norm.weight)
        self.folded = True
        return True

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        kv_cache: torch.Tensor,
        capture: HiddenCapture | None = None,
    ) -> torch.Tensor:
        """Returns the final-norm hidden states [tokens, hidden]; kv_cache is [L, 2, ...]."""
        return self._final(*self._layers(input_ids, positions, batch, kv_cache, capture),
                           capture)

    def decode_logits(self, input_ids, positions, batch, kv_cache, capture, out) -> None:
        """forward, then the float32 logits of every row into `out`. At one row on CUDA with the
        norms folded, and the final norm's rows not captured, the final norm is done by the
        lm_head's GEMV (one kernel instead of the norm's and cuBLAS's)."""
        x, residual = self._layers(input_ids, positions, batch, kv_cache, capture)
        w = self.lm_head.weight
        if (residual is None and (capture is None or not capture.wants(len(self.layers)))
                and gemv_fits(x, w) and self.parallel is None):
            gemv(x, w, out=out, norm=(self.norm.weight, self.norm.eps))
        else:
            self.logits(self._final(x, residual, capture), out=out)

    def _final(self, x, residual, capture):
        """The final norm of _layers' (x, residual), its rows captured."""
        x = self.norm(x, residual)[0] if residual is not None else self.norm(x)
        if capture is not None:
            capture.store(len(self.layers), x)
        return x

    def _rotaries(self, input_ids, positions):
        """(embedded rows, rope, the sliding layers' own rope or None)."""
        if self.parallel is not None:  # NOTE: rank 0 samples: its tokens are the inputs
            self.parallel.broadcast(input_ids)
        fused = input_ids.is_cuda
        if fused:  # NOTE: one kernel
            x, cos, sin = embed_rotary(input_ids, positions, self.embed, self.inv_freq)
            rope = Rotary(cos, sin, fused=True)
        else:
            x = F.embedding(input_ids, self.embed)
            rope = rotary_for(positions, self.inv_freq, x.dtype, fused)
        local = None
        if self.inv_freq_local is not None:
            local = rotary_for(positions, self.inv_freq_local, x.dtype, fused)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        return x, rope, local

    def _layers(self, input_ids, positions, batch, kv_cache, capture):
        """embed -> layers: (x, residual) to which the final norm applies (residual None when
        the norms are folded: x is the stream)."""
        x, rope, local = self._rotaries(input_ids, positions)
        if capture is not None:
            capture.store(0, x)
        last = len(self.layers)
        if self.folded:
            for i, layer in enumerate(self.layers):
                x = layer.forward_folded(x, rope, batch, kv_cache[i])
                if capture is not None and i + 1 < last and capture.wants(i + 1):
                    capture.store(i + 1, x)  # NOTE: the stream is the layer's output
            return x, None
        residual = None
        for i, layer in enumerate(self.layers):
            r = local if layer.attn.local_rope else rope
            x, residual = layer(x, residual, r, batch, kv_cache[i])
            if capture is not None and i + 1 < last and capture.wants(i + 1):
                # NOTE: the layer's output, as the next norm sees it
                capture.store(i + 1, residual + x)
        return x, residual

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [rows, vocab] (into `out` when given); under tensor parallelism each
        rank's vocabulary shard, gathered."""
        if self.parallel is None:
            return self._softcap(self._head(hidden, out))
        full = self.parallel.gather_vocab(self._head(hidden), self.spec.vocab_size)
        return self._softcap(full if out is None else out.copy_(full))

    def _head(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """float32 hidden @ lm_head^T (this rank's rows). On CUDA the GEMM writes float32 itself:
        no half-precision logits to convert (at batch 64 that copy moved 49 MB a step)."""
        w = self.lm_head.weight
        if hidden.is_cuda and w is not None:
            if w.dtype == torch.float32:
                return torch.mm(hidden, w.t(), out=out)
            return torch.mm(hidden, w.t(), out_dtype=torch.float32, out=out)
        logits = self.lm_head(hidden)
        return logits.float() if out is None else out.copy_(logits)

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        """Gemma's final soft-capping, in place: cap * tanh(logits / cap)."""
        cap = self.spec.logit_softcap
        return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)
