"""Geometry of representations: covariance spectra ("SVD volume") and Fourier amplitude of token maps.

Pure functions (no I/O) after Park et al., "What do self-supervised ViTs learn?" (ICLR 2023) and
Park & Kim, "How do vision transformers work?" (ICLR 2022).
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

#: floor for eigenvalues / amplitudes before taking logs
EPS = 1e-12


def covariance_spectrum(x: Tensor) -> Tensor:
    """Eigenvalues (= singular values) of the covariance of the rows of ``x``, descending, float64.

    x: (..., n, D) -> (..., min(n, D)). Computed from the singular values of the centred rows:
    λ_i = σ_i² / (n - 1), taken as the eigenvalues of the smaller Gram form.
    """
    x = x.double()
    n, d = x.shape[-2:]
    if n < 2:
        raise ValueError(f"a covariance needs at least 2 rows, got {n}")
    xc = x - x.mean(dim=-2, keepdim=True)
    # eigenvalues of the smaller of the two Gram forms (same non-zero spectrum, much cheaper than an SVD)
    g = xc @ xc.transpose(-1, -2) if n <= d else xc.transpose(-1, -2) @ xc
    return torch.linalg.eigvalsh(g).flip(-1).clamp_min(0) / (n - 1)


def token_log_spectrum(tokens: Tensor) -> Tensor:
    """Token-level "SVD volume" [Park et al. 2023]: per image, log eigenvalues of the covariance of its patch
    tokens. tokens: (B, S, D) -> (B, min(S, D)) float64, descending."""
    return covariance_spectrum(tokens).clamp_min(EPS).log()


def spectrum_from_moments(sum_x: Tensor, sum_xx: Tensor, n: int) -> Tensor:
    """Eigenvalues of the covariance from streamed moments: sum_x (D,), sum_xx (D, D) over n rows, float64,
    descending. Image-level "SVD volume" = log of these for the pooled features of n images [Park et al. 2023]."""
    if n < 2:
        raise ValueError(f"a covariance needs at least 2 rows, got {n}")
    mean = sum_x.double() / n
    cov = (sum_xx.double() - n * torch.outer(mean, mean)) / (n - 1)
    ev = torch.linalg.eigvalsh((cov + cov.T) / 2)
    return ev.flip(0).clamp_min(0)


def log_amplitude_map(tokens: Tensor, grid_size: tuple[int, int]) -> Tensor:
    """Mean over channels of the log amplitude of the 2-D FFT of each channel's spatial map, centred with
    fftshift. tokens: (B, h*w, D) patch tokens -> (B, h, w) float64 [Park & Kim 2022]. Amplitudes below 1e-12
    are floored there (log ~ -27.6)."""
    h, w = grid_size
    B, S, D = tokens.shape
    if S != h * w:
        raise ValueError(f"{S} tokens do not fill a {h}x{w} grid")
    maps = tokens.float().transpose(1, 2).reshape(B, D, h, w)  # FFT in float32; the channel mean in float64
    amp = torch.fft.fft2(maps).abs().clamp_min(EPS).log().mean(dim=1, dtype=torch.float64)
    return torch.fft.fftshift(amp, dim=(-2, -1))


def diagonal_log_amplitude(tokens: Tensor, grid_size: tuple[int, int]) -> Tensor:
    """The diagonal of :func:`log_amplitude_map` without the rest of the map: for j = 0 .. steps - 1 (the
    same steps as :func:`diagonal_profile`), the mean over channels of log |X(j, j)|, X the 2-D DFT of each
    channel's spatial map. tokens: (B, h*w, D) -> (B, steps) float64. The few DFT coefficients are one
    float32 matrix product with a cos / sin basis, instead of a full FFT and a log of every frequency."""
    h, w = grid_size
    B, S, D = tokens.shape
    if S != h * w:
        raise ValueError(f"{S} tokens do not fill a {h}x{w} grid")
    steps = min(h - h // 2, w - w // 2)
    r, c = torch.meshgrid(torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64),
                          indexing="ij")
    j = torch.arange(steps, dtype=torch.float64)
    phase = 2 * torch.pi * (r.reshape(-1, 1) / h + c.reshape(-1, 1) / w) * j  # (S, steps)
    basis = torch.cat([phase.cos(), phase.sin()], 1).T.to(tokens.device, torch.float32)  # (2 steps, S)
    coef = basis @ tokens.float()  # (B, 2 steps, D): real part and minus the imaginary part
    amp = torch.hypot(coef[:, :steps], coef[:, steps:])
    return amp.clamp_min(EPS).log().mean(dim=-1, dtype=torch.float64)


def diagonal_profile(amp_map: Tensor) -> tuple[Tensor, Tensor]:
    """Δ log amplitude along the diagonal from the centre (frequency 0) to the corner of a centred map
    (h, w): returns (frequencies in units of π, log A(f) - log A(0)). Frequency of step j is 2j/max(h, w)."""
    h, w = amp_map.shape[-2:]
    ch, cw = h // 2, w // 2
    j = torch.arange(min(h - ch, w - cw))
    return profile_of_diagonal(amp_map[..., ch + j, cw + j], (h, w))


def profile_of_diagonal(diag: Tensor, grid_size: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """:func:`diagonal_profile` of a diagonal already taken (e.g. :func:`diagonal_log_amplitude`, ``(..., steps)``)
    on a ``grid_size`` map: (frequencies 2j / max(h, w) in units of π, log A(f) - log A(0))."""
    j = torch.arange(diag.shape[-1], dtype=torch.float64)
    return 2 * j / max(grid_size), diag - diag[..., :1]
