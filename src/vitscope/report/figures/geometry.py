"""Figures of the geometry analyses (`vitscope.analyses.geometry`)."""

from __future__ import annotations

import matplotlib as mpl
import pandas as pd

from vitscope.references import cite
from vitscope.report.figures._common import (
    Figures,
    band_handle,
    colorbar,
    decoder_starts,
    grid_shape,
    has_interval,
    layer_figure,
    layer_lines,
    legend_outside,
    model_label,
    models_of,
    panels,
    plt,
    style_handle,
)


def svd_volume(df: pd.DataFrame) -> Figures:
    """Log volume per layer, token level and image level, one line per model [Park et al. 2023 "SVD
    analysis"]; the token level (a mean over images) with its 95 % band."""
    fig, axes = panels(1, 2, panel=(3.6, 2.8))
    for ax, level in zip(axes[0], ("token", "image"), strict=True):
        layer_lines(ax, df, f"{level}_log_volume", title=f"{level} level")
    axes[0, 0].set_ylabel("mean log eigenvalue (top k)")
    extra = [style_handle("--", "dashed: isotropic Gaussian features, same variance")]
    if has_interval(df):
        extra.append(band_handle())
    legend_outside(fig, extra=extra)
    return [("Volume occupied by the tokens of one image (left) and by the images (right), per layer: "
             "higher = spread over more directions (dashed: isotropic Gaussian features of the same shape and "
             f"variance, the most that variance can fill) [{cite('park2023')}]", fig)]


def fourier(df: pd.DataFrame) -> Figures:
    """Δ log amplitude at the highest frequency per layer (95 % band) [Park et al. 2023 "Fourier analysis"], and
    the curves of every layer, one panel per model with a colour scale for the block."""
    out: Figures = []
    fig = layer_figure(df, "high_freq_delta_log_amp", "Δ log amplitude (highest freq.)",
                       extra=[style_handle("--", "dashed: white-noise tokens, same shape")])
    out.append(("High-frequency amplitude of the token maps per layer: closer to 0 = more high-frequency "
                f"(texture-like) content (dashed: white-noise tokens of the same shape) [{cite('park2023')}]", fig))
    curves = df[df.metric == "delta_log_amp"]
    models = models_of(curves)
    if models:
        rows, cols = grid_shape(len(models), 4)
        fig, axes = panels(rows, cols, panel=(2.8, 2.3), sharey=True)
        depth = int(curves["layer"].max()) + 1
        norm = mpl.colors.Normalize(vmin=0, vmax=max(depth - 1, 1))
        cmap = plt.get_cmap("viridis")
        for ax, model in zip(axes.flat, models, strict=False):
            g = curves[curves.model == model]
            for layer in sorted(g["layer"].dropna().unique()):
                h = g[g.layer == layer].sort_values("freq")
                ax.plot(h["freq"], h["value"], color=cmap(norm(layer)), lw=1)
            ax.set_title(model_label(model, lines=True), fontsize=8)
            ax.set_xlabel("frequency (× π)")
            ax.grid(alpha=0.3)
        for ax in axes.flat[len(models):]:
            ax.set_axis_off()
        for ax in axes[:, 0]:
            ax.set_ylabel("Δ log amplitude")
        starts = sorted(set(decoder_starts(curves).values()))
        colorbar(fig, mpl.cm.ScalarMappable(norm=norm, cmap=cmap), axes,
                 "block" + (f" (from {', '.join(map(str, starts))}: MAE decoder)" if starts else ""))
        out.append(("Relative log amplitude vs frequency, every layer of every model (colour = block) "
                    f"[{cite('park2023')}]", fig))
    return out


def tsne(df: pd.DataFrame) -> Figures:
    """Token t-SNE per layer, a panel per model, tokens coloured by image (the legend names them) [Park et al.
    2023]."""
    out: Figures = []
    d = df[df.metric == "tsne"]
    for layer, gl in d.groupby("layer", sort=True):
        models = models_of(gl)
        rows, cols = grid_shape(len(models), 4)
        fig, axes = panels(rows, cols, panel=(2.5, 2.4))
        images = sorted(dict.fromkeys(gl["image"]))
        colors = {img: plt.get_cmap("tab10")(k % 10) for k, img in enumerate(images)}
        labels = {}
        for img in images:
            cls = gl[gl.image == img]["value"].iloc[0]
            labels[img] = f"image {int(img)}" + (f" (class {int(cls)})" if cls >= 0 else "")
        for ax, model in zip(axes.flat, models, strict=False):
            g = gl[gl.model == model]
            for img in images:
                h = g[g.image == img]
                ax.scatter(h["x"], h["y"], s=4, color=colors[img], alpha=0.8, lw=0)
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(model_label(model, lines=True), fontsize=8)
        for ax in axes.flat[len(models):]:
            ax.set_axis_off()
        handles = [style_handle("o", labels[i], color=colors[i], ms=4) for i in images]
        legend_outside(fig, handles=handles, title="tokens of")
        out.append((f"t-SNE of the patch tokens of {len(images)} images at block {int(layer)}, a panel per model, one "
                    "colour per image: separate blobs = each image's tokens look alike (contrastive models, per "
                    f"{cite('park2023')}); mixed = tokens carry local content", fig))
    return out


FIGURES = {"svd_volume": svd_volume, "fourier": fourier, "tsne": tsne}
