"""What the parity and HTTP tests share: seeded latents, cosine, PSNR, a parity check.

Computed here, independently of ``app`` (a test must not grade the code with its own ruler).
"""

from __future__ import annotations

import math

import numpy as np
import torch


def latent(*shape: int, seed: int = 0) -> torch.Tensor:
    """A seeded N(0, 1) float32 tensor of ``shape``."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine of two tensors, flattened, in float64."""
    a, b = a.detach().double().flatten().cpu(), b.detach().double().flatten().cpu()
    return float(a @ b / (a.norm() * b.norm()))


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of two uint8-range images; inf when identical."""
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float(10 * np.log10(255.0**2 / mse)) if mse else math.inf


def report(name: str, got: torch.Tensor, expected: torch.Tensor) -> float:
    """Print cosine and max-abs error of ``got`` against ``expected``; return the cosine."""
    cos = cosine(got, expected)
    err = (got.double() - expected.double()).abs().max().item()
    print(f"{name}: shape={list(got.shape)} cos={cos:.12f} (1-cos {1 - cos:.1e}) max_abs={err:.2e}")
    return cos


def check(
    name: str,
    got: torch.Tensor,
    expected: torch.Tensor,
    min_cos: float = 0.99999,
    dtype: torch.dtype | None = None,
) -> None:
    """``got`` has ``expected``'s shape (and ``dtype``) and a cosine of at least ``min_cos``."""
    cos = report(name, got, expected)
    assert got.shape == expected.shape
    assert dtype is None or got.dtype == dtype
    assert cos >= min_cos
