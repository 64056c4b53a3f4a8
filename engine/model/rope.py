"""Rotary position embeddings (RoPE) with the config's base and optional frequency scaling."""
from __future__ import annotations

import math

import torch

from engine.config import RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Per-pair rotation frequencies [head_dim // 2], float64, scaled as the config asks."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    return _llama3_scaled(inv_freq, scaling)


def _llama3_scaled(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = s.original_max_position / s.low_freq_factor
    high_freq_wavelen = s.original_max_position / s.high_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Caches cos/sin for every position up to max_positions, for the backend's rotation in the half-split layout.

    Plain tensors rather than module buffers, created on `device` explicitly, so that a model built on the
    meta device (to skip weight initialisation) still gets real tables.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None,
                 device: torch.device | str = "cpu") -> None:
        inv_freq = inverse_frequencies(head_dim, theta, scaling).to(device="cpu", dtype=torch.float32)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"), inv_freq)  # [P, D/2]
        self.cos = angles.cos().to(device)
        self.sin = angles.sin().to(device)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D/2] for the given positions; computed once per step and shared by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)
