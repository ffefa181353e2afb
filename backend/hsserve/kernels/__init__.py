"""Attention and fused kernels: torch reference versions (CPU and test oracle) live beside the
Triton-language versions used on CUDA."""
