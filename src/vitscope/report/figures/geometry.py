"""Figures of the geometry analyses (`vitscope.analyses.geometry`)."""

from __future__ import annotations

import pandas as pd

from vitscope.report.figures._common import Figures, layer_figure, layer_lines, plt


def svd_volume(df: pd.DataFrame) -> Figures:
    """Log volume per layer, token level and image level, one line per model [Park et al. 2023 "SVD analysis"]."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, level in zip(axes, ("token", "image"), strict=True):
        layer_lines(ax, df, f"{level}_log_volume", title=f"{level} level")
    axes[0].set_ylabel("mean log eigenvalue (top k)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return [("Volume occupied by the tokens of one image (left) and by the images (right), per layer: "
             "higher = spread over more directions (dashed: isotropic Gaussian features of the same shape and "
             "variance, the most that variance can fill)", fig)]


def fourier(df: pd.DataFrame) -> Figures:
    """Δ log amplitude at the highest frequency per layer [Park et al. 2023 "Fourier analysis"], and the curves."""
    out: Figures = []
    fig = layer_figure(df, "high_freq_delta_log_amp", "Δ log amplitude (highest freq.)")
    out.append(("High-frequency amplitude of the token maps per layer: closer to 0 = more high-frequency "
                "(texture-like) content (dashed: white-noise tokens of the same shape)", fig))
    curves = df[df.metric == "delta_log_amp"]
    for model, g in curves.groupby("model", sort=False):
        fig, ax = plt.subplots(figsize=(4.2, 3.2))
        layers = sorted(g["layer"].dropna().unique())
        cmap = plt.get_cmap("viridis")
        for i, layer in enumerate(layers):
            h = g[g.layer == layer].sort_values("freq")
            ax.plot(h["freq"], h["value"], color=cmap(i / max(len(layers) - 1, 1)), lw=1)
        ax.set_xlabel("frequency (× π)")
        ax.set_ylabel("Δ log amplitude")
        ax.set_title(f"{model} (dark = early, light = late)", fontsize=8)
        fig.tight_layout()
        out.append((f"Relative log amplitude vs frequency for every layer of {model}", fig))
    return out


FIGURES = {"svd_volume": svd_volume, "fourier": fourier}


def tsne(df: pd.DataFrame) -> Figures:
    """Token t-SNE per model and layer, tokens coloured by image [Park et al. 2023]."""
    out: Figures = []
    for (model, layer), g in df[df.metric == "tsne"].groupby(["model", "layer"], sort=False):
        fig, ax = plt.subplots(figsize=(3.6, 3.4))
        images = list(dict.fromkeys(g["image"]))
        for k, img in enumerate(images):
            h = g[g.image == img]
            ax.scatter(h["x"], h["y"], s=4, color=plt.get_cmap("tab10")(k % 10), alpha=0.8)
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_title(f"{model}, block {int(layer)}", fontsize=8)
        fig.tight_layout()
        out.append((f"t-SNE of the patch tokens of {len(images)} images ({model}, block {int(layer)}), one colour per "
                    "image: separate blobs = each image's tokens look alike", fig))
    return out


FIGURES["tsne"] = tsne
