"""Figures show the numbers of the tables they are drawn from, and their count does not grow with models."""

import numpy as np
import pandas as pd

from vitscope.report.figures import FIGURES


def _cka_table(models, views, depth, rng):
    rows = []
    for i, a in enumerate(models):
        for b in models[i:]:
            for v in views:
                for la in range(depth):
                    for lb in range(depth):
                        rows.append({"model": a, "model_b": b, "token_view": v, "metric": "cka_minibatch",
                                     "tap": f"block{la}.out", "tap_b": f"block{lb}.out", "layer": la,
                                     "layer_b": lb, "value": rng.uniform()})
    return pd.DataFrame(rows)


def test_cka_figure_is_one_grid_per_view_whose_panels_hold_the_table():
    rng = np.random.default_rng(0)
    models, views, depth = ["m0", "m1", "m2", "m3"], ["cls", "gap"], 5
    df = _cka_table(models, views, depth, rng)
    figs = FIGURES["cka"](df)
    assert len(figs) == len(views)
    for (caption, fig), view in zip(figs, views, strict=True):
        assert view in caption
        panels = [ax for ax in fig.axes if ax.images and ax.get_label() != "<colorbar>"]
        assert len(panels) == len(models) * (len(models) + 1) // 2
        for ax in panels:
            ma, mb = ax.get_ylabel(), ax.get_xlabel()
            g = df[(df.model == ma) & (df.model_b == mb) & (df.token_view == view)]
            want = np.zeros((depth, depth))
            want[g.layer.to_numpy(), g.layer_b.to_numpy()] = g.value.to_numpy()
            np.testing.assert_allclose(np.asarray(ax.images[0].get_array()), want)


def test_residual_cka_figure_is_one_per_view_with_a_row_per_model():
    rng = np.random.default_rng(1)
    rows = [{"model": m, "token_view": v, "metric": f"skip_vs_{br}", "layer": i, "layer_b": j,
             "value": rng.uniform()}
            for m in ("a", "b", "c") for v in ("gap",) for br in ("attn_out", "mlp_out")
            for i in range(4) for j in range(4)]
    df = pd.DataFrame(rows)
    figs = FIGURES["residual_cka"](df)
    assert len(figs) == 1
    panels = [ax for ax in figs[0][1].axes if ax.images and ax.get_label() != "<colorbar>"]
    assert len(panels) == 6
    for k, ax in enumerate(panels):
        model, branch = "abc"[k // 2], ("attn_out", "mlp_out")[k % 2]
        g = df[(df.model == model) & (df.metric == f"skip_vs_{branch}")]
        want = g.pivot_table(index="layer", columns="layer_b", values="value").to_numpy()
        np.testing.assert_allclose(np.asarray(ax.images[0].get_array()), want)
