"""Mixture-of-experts feed-forward (Mixtral, Qwen3-MoE): a router picks each token's top-k
experts by softmax probability (renormalized over the chosen when the model says so), and the
token's output is the weighted sum of those experts' SwiGLU MLPs.

The experts run in kernels/moe.py (a grouped GEMM on CUDA, its torch reference elsewhere). The
router's logits are computed in float64: a product's last bits may depend on how many rows it has
(the BLAS picks its kernel by shape), and in float32 that could flip a near-tie between two
experts with the batch's composition; an exact tie (identical router rows) stays exact and goes
the same way whatever the batch. At decode sizes on CUDA the logits come from router_logits
(kernels/moe_route.py: the same float64 sums of exact products, chained with the routing and the
experts' launches); a near-tie within float64 rounding could go either way between it and the
BLAS, none that float32 or bfloat16 could tell apart.

With the norms folded (Decoder.fold_norms, on CUDA) the layer takes the residual stream: the norm
before it, without its weight (folded into the router and gate_up), is done by the router kernel
at decode sizes (by add_rmsnorm above), and the output is added into the stream by the pairs'
sum. At one token gate_up's programs route the token themselves (kernels/moe.py
one_token_experts): router, gate_up, down and the sum are the layer's four launches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hsserve.kernels.moe import block_rows, experts_ref, fused_experts, one_token_experts
from hsserve.kernels.elementwise import add_rmsnorm
from hsserve.kernels.moe_route import decode_route, normed_logits, routes_in_kernel
from hsserve.kernels.pdl import pdl_on
from hsserve.models.spec import ModelSpec


class MoE(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        e, i, h = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size
        # NOTE: the router is a plain F.linear (as transformers'), never a packed CPU weight
        self.router = nn.Parameter(torch.empty(e, h), requires_grad=False)
        self.gate_up = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.down = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        self.top_k, self.renormalize = spec.experts_per_token, spec.norm_topk_prob
        self._router64: torch.Tensor | None = None  # NOTE: made by prepare(), after loading
        self._ones = None
        # NOTE: Mixtral weighs an expert's output in float32, Qwen3-MoE in the model's dtype
        self.weigh_in_float = spec.family == "mixtral"
        self.reduce = None  # NOTE: tensor parallelism: each expert's rank share summed (Linear's)

    def prepare(self) -> None:
        """After loading: the router's float64 copy and fold_norm's weight of ones (made here,
        not inside a graph capture)."""
        self._router64 = self.router.double()
        self._ones = self.gate_up.new_ones(self.gate_up.shape[-1])  # NOTE: fold_norm's norm

    @torch.no_grad()
    def fold_norm(self, weight: torch.Tensor) -> None:
        """The norm before (its weight [hidden]) folded into the router and every expert's gate_up
        (Decoder.fold_norms): forward then takes the residual stream. The router's rows become
        float32 (a product of two bfloat16 is exact in it: no rounding is added to the router)."""
        w = weight.float()
        for e in range(len(self.gate_up)):  # NOTE: an expert at a time: a small float32 copy
            g = self.gate_up[e]
            g.copy_((g.float() * w[None, :]).to(g.dtype))
        self.router = nn.Parameter(self.router.float() * w[None, :], requires_grad=False)
        self.prepare()

    def logits(self, x: torch.Tensor, x64: torch.Tensor | None = None) -> torch.Tensor:
        """The router's float64 logits [tokens, experts] (x64: x already widened)."""
        if self._router64 is None:
            self.prepare()
        return F.linear(x.double() if x64 is None else x64, self._router64)

    def route(self, x: torch.Tensor, x64: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [tokens, hidden] -> (weights [tokens, k] float32, experts [tokens, k])."""
        probs = torch.softmax(self.logits(x, x64), dim=-1).float()
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def routes_in_kernel(self, x: torch.Tensor) -> bool:
        """Whether x's rows are routed by the decode kernels (no float64 copy of x needed)."""
        return x.is_cuda and routes_in_kernel(len(x), self.top_k, self.router.shape[0])

    def router_input_buffer(self, x: torch.Tensor) -> torch.Tensor | None:
        """Room for x's rows in float64, for the norm before to fill: None when the decode kernels
        route x (they widen it themselves)."""
        return None if self.routes_in_kernel(x) else x.new_empty(x.shape, dtype=torch.float64)

    def forward(self, x: torch.Tensor, folded_eps: float | None = None,
                router_input: torch.Tensor | None = None) -> torch.Tensor:
        """x: the normed rows (router_input: them in float64, when the norm before wrote it, else
        cast here) -> the experts' output. folded_eps (fold_norm's layers): x is the residual
        stream, normed here without a weight, and the output is added into it (returned)."""
        into = x if folded_eps is not None and self.reduce is None else None
        if self._ones is None:
            self.prepare()
        if x.is_cuda and len(x) == 1:  # NOTE: router, then gate_up routing as it goes
            pdl = pdl_on(x)
            rows, logits = normed_logits(x, self.router, pdl, folded_eps)
            out = one_token_experts(rows, logits, self.gate_up, self.down, self.top_k,
                                    self.renormalize, pdl, into)
        elif self.routes_in_kernel(x):  # NOTE: decode: router, routing, experts, sum chained
            pdl = pdl_on(x)
            rows, routed = decode_route(x, self.router, self.top_k, self.renormalize,
                                        block_rows(len(x) * self.top_k), pdl, folded_eps)
            weights, experts, ids, blocks = routed
            out = fused_experts(rows, self.gate_up, self.down, weights, experts,
                                self.weigh_in_float, (ids, blocks), pdl=pdl, into=into)
        else:
            rows = x
            if folded_eps is not None:  # NOTE: a weight of ones: the normed rows exactly
                router_input = x.new_empty(x.shape, dtype=torch.float64)
                rows = add_rmsnorm(x, None, self._ones, folded_eps, router_input)[0]
            weights, experts = self.route(rows, router_input)
            if x.is_cuda:
                out = fused_experts(rows, self.gate_up, self.down, weights, experts,
                                    self.weigh_in_float, into=into)
            else:
                out = experts_ref(rows, self.gate_up, self.down, weights, experts,
                                  self.weigh_in_float)
                out = out if into is None else into.add_(out)
        if self.reduce is not None:
            out = self.reduce(out)
            out = out if folded_eps is None else x.add_(out)
        return out
