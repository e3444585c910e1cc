"""Softmax attention in memory linear in the sequence length, for the mid blocks.

A VAE mid block attends over every latent pixel: at a 2048^2 input that is 65536 tokens, and
an L x L score matrix of 16 GiB in float32. ``attend`` never builds one. PyTorch's fused
kernels (the CPU flash kernel, CUDA's flash / memory-efficient ones) keep O(L * d) work; they
run only on inputs whose last dimension is contiguous, which ``attend`` ensures. Where no fused
kernel applies (another device, a disabled backend; also the meta device) the queries go in
chunks of ``d`` rows: each chunk's scores are the size of ``k``. Exact either way: each query
row's softmax is independent of the others.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend


def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """``scaled_dot_product_attention(q, k, v)`` for ``[B, H, L, d]`` inputs, without L x L."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if SDPBackend(torch._fused_sdp_choice(q, k, v)) != SDPBackend.MATH:
        return F.scaled_dot_product_attention(q, k, v)
    rows = q.shape[-1]
    if q.shape[-2] <= rows:
        return F.scaled_dot_product_attention(q, k, v)
    chunks = [
        F.scaled_dot_product_attention(q[..., i : i + rows, :], k, v)
        for i in range(0, q.shape[-2], rows)
    ]
    return torch.cat(chunks, dim=-2)
