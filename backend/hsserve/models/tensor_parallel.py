"""Tensor parallelism, the model's side: which slice of each weight a rank holds, and the three
collectives the decoder calls (the engine's side, ranks as processes: engine/ranks.py).

Column-parallel: qkv (by attention heads; K/V heads replicated where there are fewer than ranks)
and gate_up (by the intermediate size); row-parallel, their partial products summed over the
ranks: o_proj and down (a MoE layer's experts likewise, each split by its intermediate size).
The embedding, the norms and a router are whole on every rank, so the residual stream is whole
after each sum and hidden rows are rank 0's. The lm_head is split by vocabulary and the logits
gathered. Rank 0's input tokens are broadcast first: only it samples.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from hsserve.models.spec import ModelSpec


@dataclass(frozen=True)
class TensorParallel:
    rank: int
    size: int
    group: object  # NOTE: a torch ProcessGroup of the ranks: gloo on the CPU, NCCL on CUDA

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place."""
        self.group.allreduce([x]).wait()
        return x

    def all_max(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise largest of the ranks' x, in place (row-parallel inputs' amax)."""
        self.group.allreduce([x], torch.distributed.ReduceOp.MAX).wait()
        return x

    def agree_min(self, value: int) -> int:
        """The smallest of the ranks' values (e.g. KV blocks that fit on every device)."""
        t = torch.tensor([value], dtype=torch.int64)
        if getattr(self.group, "name", lambda: "")() == "nccl":
            t = t.cuda()
        self.group.allreduce([t], torch.distributed.ReduceOp.MIN).wait()
        return int(t.item())

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank, in place."""
        self.group.broadcast(x, 0).wait()
        return x

    def vocab_rows(self, vocab: int) -> int:
        """Rows of the lm_head shard (the last one padded with zero rows)."""
        return -(-vocab // self.size)

    def gather_vocab(self, local: torch.Tensor, vocab: int) -> torch.Tensor:
        """The ranks' logits [rows, vocab_rows] -> [rows, vocab], in rank order."""
        rows, cols = local.shape
        flat = local.new_empty(self.size * rows, cols)
        self.group._allgather_base(flat, local.contiguous()).wait()
        return flat.view(self.size, rows, cols).permute(1, 0, 2).reshape(rows, -1)[:, :vocab]


def local_spec(spec: ModelSpec, size: int, rank: int = 0) -> ModelSpec:
    """The shape rank `rank` of `size` holds; ValueError naming tensor_parallel_size where the
    model does not split so. Where the ranks do not divide them, the K/V heads (each with its
    query heads) and the intermediate sizes are shared out as evenly as they go."""
    if size == 1:
        return spec
    h, kvh = spec.num_heads, spec.num_kv_heads
    if kvh < size and (size % kvh or h % size):
        raise ValueError(f"tensor_parallel_size: {size} does not split the model's {h} attention "
                         f"heads over {kvh} key/value heads (with fewer key/value heads than "
                         "ranks, the ranks must divide the attention heads and be a multiple of "
                         "the key/value heads)")
    q, kv = _q_span(spec, size, rank), _kv_span(spec, size, rank)
    inter = _share(spec.intermediate_size, size, rank)
    moe = _share(spec.moe_intermediate_size, size, rank)
    if inter.stop == inter.start or (spec.num_experts and moe.stop == moe.start):
        raise ValueError(f"tensor_parallel_size: {size} is more ranks than the model's "
                         "intermediate size has columns")
    return replace(spec, num_heads=q.stop - q.start, num_kv_heads=kv.stop - kv.start, intermediate_size=inter.stop - inter.start,
                   moe_intermediate_size=moe.stop - moe.start)


def _share(total: int, size: int, rank: int) -> slice:
    """Rank `rank`'s contiguous share of `total`, the first total % size ranks one more."""
    n, extra = divmod(total, size)
    start = rank * n + min(rank, extra)
    return slice(start, start + n + (rank < extra))


def _kv_span(spec: ModelSpec, size: int, rank: int) -> slice:
    """This rank's K/V heads: its share, or the one its query heads read."""
    kvh = spec.num_kv_heads
    if kvh >= size:
        return _share(kvh, size, rank)
    k = rank * kvh // size
    return slice(k, k + 1)


def _q_span(spec: ModelSpec, size: int, rank: int) -> slice:
    """This rank's query heads: those of its K/V heads, or its share of them."""
    if spec.num_kv_heads < size:
        return _share(spec.num_heads, size, rank)
    group = spec.num_heads // spec.num_kv_heads
    kv = _kv_span(spec, size, rank)
    return slice(kv.start * group, kv.stop * group)


def _rows(s: slice, unit: int, offset: int = 0) -> slice:
    return slice(offset + s.start * unit, offset + s.stop * unit)


def pieces(spec: ModelSpec, size: int, rank: int, ours: str, num_parts: int
           ) -> list[tuple[int, int, slice]]:
    """How rank `rank` reads parameter `ours` from its checkpoint parts (which are concatenated
    on dim 0 whole): a list of (part, dim, slice), concatenated on dim 0. `spec` is the whole
    model's."""
    whole = [(i, 0, slice(None)) for i in range(num_parts)]
    if size == 1:
        return whole
    d = spec.head_dim
    q = _rows(_q_span(spec, size, rank), d)
    kv = _rows(_kv_span(spec, size, rank), d)
    inter = spec.moe_intermediate_size if ours.endswith(("mlp.gate_up", "mlp.down")) else \
        spec.intermediate_size
    mid = _share(inter, size, rank)
    if ours.endswith(("attn.qkv.weight", "attn.qkv.bias")):
        if num_parts == 1:  # NOTE: a fused qkv_proj (Phi-3): q, k, v row ranges of one tensor
            qs, kvs = spec.num_heads * d, spec.num_kv_heads * d
            return [(0, 0, q), (0, 0, _rows(kv, 1, qs)), (0, 0, _rows(kv, 1, qs + kvs))]
        return [(0, 0, q), (1, 0, kv), (2, 0, kv)]
    if ours.endswith("attn.o_proj.weight"):
        return [(0, 1, q)]
    if ours.endswith(("mlp.gate_up.weight", "mlp.gate_up")):
        if num_parts == 1:  # NOTE: a fused gate_up_proj (Phi-3)
            return [(0, 0, mid), (0, 0, _rows(mid, 1, inter))]
        return [(i, 0, mid) for i in range(num_parts)]  # NOTE: gate, up (per expert)
    if ours.endswith(("mlp.down.weight", "mlp.down")):
        return [(i, 1, mid) for i in range(num_parts)]
    if ours == "lm_head.weight":
        n = -(-spec.vocab_size // size)
        return [(0, 0, slice(rank * n, min((rank + 1) * n, spec.vocab_size)))]
    return whole
