"""Subspace similarity (Ramasesh et al. 2021), the `similarity` analysis' opt-in measure ``subspace_similarity``:
the function against a direct SVD and projection written here, its fixed points (identical -> 1, orthogonal
subspaces -> 0), its invariances, its chance level, and the analysis on two tiny models against the same direct
computation on features extracted with `vitscope.capture.engine.extract` (values, jackknife errors, the
``pretrained`` column of a fine-tuned pair and its per-layer figure). Both variants of ``subspace_space``: 'images'
(left singular vectors, any widths) and 'features' (Ramasesh et al.'s right singular vectors, equal widths; 'auto'
picks it there), each against its own direct SVD."""

import types

import numpy as np
import pytest
import torch

from conftest import tiny
from vitscope.analyses import get_analysis
from vitscope.capture import stream
from vitscope.capture.engine import extract
from vitscope.data import SyntheticShapes
from vitscope.errors import VitscopeError
from vitscope.metrics import similarity as M

pytestmark = pytest.mark.usefixtures("one_thread")


def reference(x, y, k):
    """||U_x,kᵀ U_y,k||_F² / k from numpy's SVD of the centred matrices, as tr(P_x P_y) / k of the projections
    P = U_k U_kᵀ onto the top-k left singular vectors (the principal components' scores over the examples)."""
    def projection(a):
        a = np.asarray(a, dtype=np.float64)
        u = np.linalg.svd(a - a.mean(0), full_matrices=False)[0][:, :k]
        return u @ u.T

    return float(np.trace(projection(x) @ projection(y)) / k)


@pytest.mark.parametrize("n, dx, dy, k", [(50, 20, 35, 5), (30, 60, 12, 10), (80, 16, 16, 1)])
def test_equals_a_direct_svd_and_projection_on_random_matrices(n, dx, dy, k):
    rng = np.random.default_rng(n + dx)
    x = rng.standard_normal((n, dx)) * np.linspace(3.0, 0.2, dx)  # distinct singular values: a unique top k
    y = 0.5 * x[:, :min(dx, dy)] @ rng.standard_normal((min(dx, dy), dy)) + rng.standard_normal((n, dy))
    got = M.subspace_similarity(x, y, k=k, space="images")
    assert got == pytest.approx(reference(x, y, k), rel=1e-8, abs=1e-10)
    assert got == pytest.approx(M.subspace_similarity(y, x, k=k, space="images"), rel=1e-8, abs=1e-10)  # symmetric
    assert 0.0 <= got <= 1.0


def test_identical_representations_give_one():
    x = np.random.default_rng(1).standard_normal((40, 25))
    assert M.subspace_similarity(x, x, k=7) == pytest.approx(1.0, abs=1e-10)
    assert M.subspace_similarity(x, x.copy() + 3.0, k=7) == pytest.approx(1.0, abs=1e-10)  # the centring


def _centred_basis(n, m, rng):
    """m orthonormal columns of length n, each orthogonal to the all-ones vector (centred scores)."""
    q = np.linalg.qr(np.column_stack([np.ones(n), rng.standard_normal((n, m))]))[0]
    return q[:, 1:m + 1]


def test_orthogonal_principal_subspaces_give_zero():
    rng = np.random.default_rng(2)
    n, k, d = 60, 4, 12
    q = _centred_basis(n, 3 * k, rng)
    strong = np.diag(np.linspace(10.0, 6.0, k))

    def layer(top, rest):  # top-k scores along ``top`` with large variance, smaller directions along ``rest``
        mix = np.linalg.qr(rng.standard_normal((d, d)))[0]
        return np.column_stack([top @ strong, rest @ np.diag([1.0, 0.5]), np.zeros((n, d - k - 2))]) @ mix

    x = layer(q[:, :k], q[:, 2 * k:2 * k + 2])
    y = layer(q[:, k:2 * k], q[:, :2])  # its small directions lie in x's top subspace: only the top k count
    assert reference(x, y, k) == pytest.approx(0.0, abs=1e-12)
    assert M.subspace_similarity(x, y, k=k, space="images") == pytest.approx(0.0, abs=1e-10)
    assert M.subspace_similarity(x, y, k=k + 2, space="images") > 0.1  # k + 2 reaches the small directions that overlap


def test_invariant_to_rotations_isotropic_scaling_and_width():
    rng = np.random.default_rng(3)
    n, d, k = 70, 15, 6
    x = rng.standard_normal((n, d)) * np.linspace(2.0, 0.3, d)
    y = x @ rng.standard_normal((d, d)) + 0.8 * rng.standard_normal((n, d))
    base = M.subspace_similarity(x, y, k=k, space="images")
    rot = np.linalg.qr(rng.standard_normal((d, d)))[0]
    wider = np.linalg.qr(rng.standard_normal((d + 9, d)))[0].T  # (d, d + 9), orthonormal rows: an isometry
    assert M.subspace_similarity(x @ rot, y, k=k, space="images") == pytest.approx(base, rel=1e-8)
    assert M.subspace_similarity(x, 7.5 * y, k=k, space="images") == pytest.approx(base, rel=1e-8)
    assert M.subspace_similarity(0.01 * x @ rot, 3.0 * y @ wider, k=k, space="images") == pytest.approx(base, rel=1e-8)
    # not a CCA-type measure: an anisotropic rescaling of the features moves the principal subspace
    assert abs(M.subspace_similarity(x * np.linspace(0.1, 5.0, d), y, k=k, space="images") - base) > 1e-3


def test_unrelated_features_score_about_k_over_n():
    rng = np.random.default_rng(4)
    n, d, k = 100, 30, 5
    values = [M.subspace_similarity(rng.standard_normal((n, d)), rng.standard_normal((n, 20)), k=k)
              for _ in range(40)]
    # independent Gaussian rows: the top-k score subspace is uniform in the (n - 1)-dim centred space, so the
    # expectation is k / (n - 1); 40 draws of a value whose spread is about its mean / 2
    assert 0.7 * k / (n - 1) < np.mean(values) < 1.3 * k / (n - 1)


def test_a_rank_below_k_compares_the_directions_there_are():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((30, 3))  # rank 3 < k = 6
    assert M.subspace_similarity(x, x, k=6) == pytest.approx(1.0, abs=1e-10)
    y = np.column_stack([x, rng.standard_normal((30, 9))])  # its top 6 hold x's 3 directions at most
    px, py = M.prepare(x, ["subspace_similarity"], subspace_k=6), M.prepare(y, ["subspace_similarity"], subspace_k=6)
    assert (px.keep_subspace, py.keep_subspace) == (3, 6)
    u_x = np.linalg.svd(x - x.mean(0), full_matrices=False)[0]
    u_y = np.linalg.svd(y - y.mean(0), full_matrices=False)[0][:, :6]
    want = float(np.sum((u_x.T @ u_y) ** 2) / 6)  # the larger count divides
    assert M.compare(px, py, ["subspace_similarity"])["subspace_similarity"] == pytest.approx(want, rel=1e-8)


def test_opt_in_declared_and_checked():
    from vitscope.measures import direction

    cls = get_analysis("similarity")
    vm = tiny("vit")
    assert "subspace_similarity" not in cls(vm).measures  # the default list is unchanged
    assert "subspace_similarity" in M.MEASURES and "subspace_similarity" not in M.DEFAULT_MEASURES
    assert cls(vm, measures=["subspace_similarity", "mean_cca"]).measures == ["mean_cca", "subspace_similarity"]
    assert direction("subspace_similarity") == "similarity" and M.range_of("subspace_similarity") == (0.0, 1.0)
    with pytest.raises(VitscopeError, match="subspace_k = 12 principal directions needs n_subset above it"):
        cls(vm, measures=["subspace_similarity"], n_subset=12, subspace_k=12)
    cls(vm, measures=["mean_cca"], n_subset=12, subspace_k=12)  # only when the measure runs
    with pytest.raises(M.FeatureError, match="subspace_k >= 1"):
        M.prepare(np.ones((5, 2)) + np.eye(5, 2), ["subspace_similarity"], subspace_k=0)


N = 24


def _run(vm, batches, **params):
    a = get_analysis("similarity")(vm, **params)
    stream(vm, batches, [a], progress=False)
    return a


def test_the_analysis_on_a_tiny_pair_equals_the_direct_computation_on_extracted_features():
    import matplotlib.pyplot as plt

    from vitscope.report.figures import FIGURES

    vm_a, vm_b = tiny("vit"), tiny("vit", seed=5)
    vm_a.name, vm_b.name = "A", "B"
    batches = list(SyntheticShapes(n=N, seed=2).batches(6, vm_a.preprocessing))
    k, groups = 4, 4
    params = dict(measures=["subspace_similarity"], subspace_k=k, n_subset=100, n_permutations=99, n_groups=groups,
                  null_pairs="matched", subspace_space="images")
    a, b = _run(vm_a, batches, **params), _run(vm_b, batches, **params)
    b.finetuned_from = "A"  # what the study sets from the model's `finetuned_from`
    cross = type(a).cross([a, b])
    assert set(cross.metric) == {"subspace_similarity"} and (cross.pretrained == "A").all()
    assert (cross.subspace_space == "images").all()
    images = torch.cat([x.images for x in batches])
    order = a.ids.numpy()  # the subset's order: the jackknife's groups are by rank in it
    taps = [f"block{i}.out" for i in range(3)]
    fa = extract(vm_a, images, taps, view="gap")
    fb = extract(vm_b, images, taps, view="gap")
    for t in taps:
        row = cross[(cross.tap == t) & (cross.tap_b == t)].iloc[0]
        xa = fa[t].half().double().numpy()[order]  # the analysis keeps float16 features
        xb = fb[t].half().double().numpy()[order]
        assert row.value == pytest.approx(reference(xa, xb, k), rel=1e-6, abs=1e-9), t
        reps = np.array([reference(xa[np.arange(N) % groups != g], xb[np.arange(N) % groups != g], k)
                         for g in range(groups)])
        se = np.sqrt((groups - 1) / groups * ((reps - reps.mean()) ** 2).sum())
        assert row.stderr == pytest.approx(se, rel=1e-5, abs=1e-9), t
        assert 0.0 <= row.value_lo <= row.value <= row.value_hi <= 1.0
        assert 0.02 < row.null_mean < 0.5  # chance: k / (N - 1) = 0.17 in expectation
    assert cross[cross.layer == 0].value.item() > cross[cross.layer == 0].null_q95.item()  # patch-level layer 0

    # the per-layer figure of the fine-tuned pair: one line with the table's values through the layers
    figs = FIGURES["similarity"](cross)
    caption, fig = next((c, f) for c, f in figs if c.startswith("Subspace similarity of each layer"))
    ax = next(x for x in fig.axes if x.get_title().startswith("A vs fine-tuned"))
    line = ax.lines[0]
    assert list(line.get_xdata()) == [0.0, 1.0, 2.0]
    assert np.allclose(line.get_ydata(), cross.sort_values("layer").value.to_numpy(dtype=float))
    for _, f in figs:
        plt.close(f)
    b.finetuned_from = None
    assert "pretrained" not in type(a).cross([a, b]).columns  # an unrelated pair: no column, no per-layer figure
    assert not any(c.startswith("Subspace similarity of each layer")
                   for c, f in FIGURES["similarity"](type(a).cross([a, b])) if plt.close(f) is None)


def test_the_figure_draws_a_line_per_epoch_in_epoch_order_either_orientation():
    import matplotlib.pyplot as plt
    import pandas as pd

    from vitscope.report.figures.similarity import subspace_per_layer

    rows = []
    for epoch, label in ((5, "ft@5"), (1, "ft@1"), (3, "ft@3")):
        for layer in range(3):
            value = 1.0 - 0.1 * epoch * (layer + 1) / 3
            row = {"model": "pre", "model_b": label, "epoch": pd.NA, "epoch_b": epoch}
            if epoch == 3:  # the fine-tuned model first: the figure turns it round
                row = {"model": label, "model_b": "pre", "epoch": epoch, "epoch_b": pd.NA}
            rows.append({**row, "metric": "subspace_similarity", "layer": layer, "layer_b": layer,
                         "tap": f"block{layer}.out", "tap_b": f"block{layer}.out", "token_view": "gap",
                         "value": value, "pretrained": "pre"})
    rows.append({**rows[0], "metric": "mean_cca"})  # other measures are not drawn here
    df = pd.DataFrame(rows).astype({"epoch": "Int64", "epoch_b": "Int64"})
    (caption, fig), = subspace_per_layer(df)
    ax = fig.axes[0]
    assert len(ax.lines) == 3
    for line, epoch in zip(ax.lines, (1, 3, 5), strict=True):
        want = [1.0 - 0.1 * epoch * (layer + 1) / 3 for layer in range(3)]
        assert np.allclose(line.get_ydata(), want)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend[:3] == ["ft@1 (epoch 1)", "ft@3 (epoch 3)", "ft@5 (epoch 5)"]
    plt.close(fig)
    assert subspace_per_layer(df.assign(pretrained=None)) == []


def test_fed_features_of_different_widths_compare():
    """Layers of different widths (e.g. ViT-S against ViT-B) get a value: the subspaces live in image space."""
    vm_a, vm_b = tiny("vit"), tiny("vit", seed=5)
    vm_a.name, vm_b.name = "A", "B"
    rng = np.random.default_rng(6)
    n = 64
    x = rng.standard_normal((n, 10)).astype(np.float32)
    y = np.column_stack([x @ rng.standard_normal((10, 10)), rng.standard_normal((n, 22))]).astype(np.float32)
    out = []
    for vm, f in ((vm_a, x), (vm_b, y)):
        a = get_analysis("similarity")(vm, taps=["block0.out"], measures=["subspace_similarity"], subspace_k=3,
                                       n_permutations=0, n_groups=0)
        for s in range(0, n, 16):
            a.update({"block0.out": torch.as_tensor(f[s:s + 16])},
                     types.SimpleNamespace(index=torch.arange(n)[s:s + 16], extra={}))
        out.append(a)
    cross = type(out[0]).cross(out)
    order = out[0].ids.numpy()
    want = reference(torch.as_tensor(x).half().double().numpy()[order],
                     torch.as_tensor(y).half().double().numpy()[order], 3)
    assert cross.value.item() == pytest.approx(want, rel=1e-6)
    assert cross.subspace_space.item() == "images"  # 'auto' across widths: the only variant defined there
    with pytest.raises(VitscopeError, match="subspace_space 'features' needs layers of the same width"):
        for an in out:
            an.subspace_space = "features"
        type(out[0]).cross(out)


@pytest.mark.slow
def test_in_a_study_per_layer_and_epoch_of_a_checkpoint_list(tmp_path):
    """A pretrained tiny model and a `checkpoints:` list fine-tuned from it (block 1 perturbed more each epoch):
    the table's pretrained -> checkpoint rows carry ``pretrained`` and ``epoch_b``; epoch 0 (the same weights) and
    block 0 (before the change) give 1, block 1 falls below it; the report's per-layer figure has a line per epoch."""
    import copy
    from pathlib import Path

    import matplotlib.pyplot as plt
    import pandas as pd

    import vitscope as vs
    from vitscope.models.load import save_checkpoint
    from vitscope.report.figures.similarity import subspace_per_layer
    from vitscope.study import load_config, run_study

    run_dir = tmp_path / "ft" / "checkpoints"
    run_dir.mkdir(parents=True)
    kw = dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3)
    pt = vs.load_model("vit_small_patch16_224", pretrained=False, seed=0, **kw)
    for e in range(3):
        vm = copy.deepcopy(pt)
        torch.manual_seed(e)
        with torch.no_grad():
            for p in vm.model.blocks[1].parameters():
                p.add_(torch.randn_like(p) * 0.5 * e)
        save_checkpoint(vm.model, run_dir / f"encoder_epoch{e:03d}.safetensors", vm.spec)
    yaml_kw = "{" + ", ".join(f"{k}: {v}" for k, v in kw.items()) + "}"
    (tmp_path / "s.yaml").write_text(f"""
models:
  - {{name: vit_small_patch16_224, label: pt, pretrained: false, kwargs: {yaml_kw}}}
  - {{label: ft, checkpoints: {tmp_path / 'ft'}, finetuned_from: pt}}
dataset: {{name: synthetic-shapes, n_images: 24}}
analyses:
  similarity: {{measures: [subspace_similarity], subspace_k: 3, n_permutations: 0, n_groups: 4, null_pairs: matched}}
batch_size: 8
progress: false
""")
    cfg = load_config(tmp_path / "s.yaml", [f"output_dir={tmp_path / 'run'}"])
    out = Path(run_study(cfg))
    df = pd.read_parquet(out / "results" / "similarity.parquet")
    tuned = df[df.pretrained.notna()] if "pretrained" in df.columns else df.iloc[:0]
    assert set(tuned.pretrained) == {"pt"} and set(tuned.model) == {"pt"}
    assert set(tuned.model_b) == {"ft@0", "ft@1", "ft@2"} and set(tuned.epoch_b) == {0, 1, 2}
    assert not df[df.pretrained.isna()].model.eq("pt").any()  # pt's rows are all of fine-tuned pairs
    value = tuned.set_index(["model_b", "layer"]).value
    assert value["ft@0", 0] == pytest.approx(1.0) and value["ft@0", 1] == pytest.approx(1.0)
    assert value["ft@2", 0] == pytest.approx(1.0) and value["ft@2", 1] < 0.99
    assert tuned.stderr.notna().all()
    assert set(tuned.subspace_space) == {"features"}  # 'auto' on one network and its fine-tune: Ramasesh et al.'s
    (caption, fig), = subspace_per_layer(df)
    assert len(fig.axes[0].lines) == 3
    plt.close(fig)


# ------------------------------------------------------------------ feature space (Ramasesh et al.'s own variant)

def feature_reference(x, y, k):
    """||V_x,kᵀ V_y,k||_F² / k with V_k the top-k right singular vectors of the centred matrices (the top-k
    eigenvectors of the feature covariance), from numpy's SVD: Ramasesh et al. 2021's measure as they define it."""
    def top(a):
        a = np.asarray(a, dtype=np.float64)
        return np.linalg.svd(a - a.mean(0), full_matrices=False)[2][:k].T  # (d, k)

    return float(np.sum((top(x).T @ top(y)) ** 2) / k)


def _pair_of_width(rng, n, d):
    """Two related (n, d) matrices with distinct feature variances (a unique top k)."""
    x = rng.standard_normal((n, d)) * np.linspace(3.0, 0.2, d)
    y = x + 0.7 * rng.standard_normal((n, d)) * np.linspace(0.5, 2.0, d)
    return x, y


@pytest.mark.parametrize("n, d, k", [(50, 20, 5), (30, 60, 10), (80, 16, 1), (12, 40, 8)])
def test_features_variant_equals_a_direct_svd_of_right_singular_vectors(n, d, k):
    x, y = _pair_of_width(np.random.default_rng(n * d), n, d)
    got = M.subspace_similarity(x, y, k=k, space="features")
    assert got == pytest.approx(feature_reference(x, y, k), rel=1e-8, abs=1e-10)
    assert got == pytest.approx(M.subspace_similarity(y, x, k=k, space="features"), rel=1e-8, abs=1e-10)
    assert 0.0 <= got <= 1.0
    # not the images variant: the two differ on these matrices
    assert abs(got - reference(x, y, k)) > 1e-4
    # the covariance's eigenvectors, a second independent route where the top k are well separated
    def cov_top(a):
        w, v = np.linalg.eigh(np.cov(a, rowvar=False))
        return v[:, ::-1][:, :k]

    if n > d:
        want = float(np.sum((cov_top(x).T @ cov_top(y)) ** 2) / k)
        assert got == pytest.approx(want, rel=1e-6, abs=1e-9)


def test_auto_picks_features_at_equal_widths_and_images_otherwise():
    rng = np.random.default_rng(11)
    x, y = _pair_of_width(rng, 40, 12)
    wide = np.column_stack([y, rng.standard_normal((40, 5))])
    assert M.subspace_similarity(x, y, k=4) == pytest.approx(feature_reference(x, y, 4), rel=1e-8)
    assert M.subspace_similarity(x, wide, k=4) == pytest.approx(reference(x, wide, 4), rel=1e-8)
    px, py, pw = (M.prepare(a, ["subspace_similarity"], subspace_k=4) for a in (x, y, wide))
    assert M.subspace_space_of("auto", px, py) == "features" and M.subspace_space_of("auto", px, pw) == "images"
    assert M.subspace_space_of("images", px, py) == "images"
    with pytest.raises(M.FeatureError, match="same width, got 12 and 17"):
        M.subspace_similarity(x, wide, k=4, space="features")
    with pytest.raises(M.FeatureError, match="subspace_space must be one of auto, features, images"):
        M.subspace_similarity(x, y, k=4, space="neurons")
    with pytest.raises(VitscopeError, match="subspace_space"):
        get_analysis("similarity")(tiny("vit"), measures=["subspace_similarity"], subspace_space="neurons")


def test_features_variant_ignores_image_order_and_sees_rotated_coordinates():
    rng = np.random.default_rng(12)
    n, d, k = 60, 14, 5
    x, y = _pair_of_width(rng, n, d)
    feats, images = (M.subspace_similarity(x, y, k=k, space=s) for s in ("features", "images"))
    perm = rng.permutation(n)
    # the same reordering of both: neither variant moves
    assert M.subspace_similarity(x[perm], y[perm], k=k, space="features") == pytest.approx(feats, rel=1e-8)
    assert M.subspace_similarity(x[perm], y[perm], k=k, space="images") == pytest.approx(images, rel=1e-8)
    # B's images alone shuffled (the permutation null): the feature-space value cannot move, so it is no null
    assert M.subspace_similarity(x, y[perm], k=k, space="features") == pytest.approx(feats, rel=1e-8)
    assert abs(M.subspace_similarity(x, y[perm], k=k, space="images") - images) > 0.05
    # B's feature coordinates rotated: the images variant cannot tell, the feature-space one compares other axes
    rot = np.linalg.qr(rng.standard_normal((d, d)))[0]
    assert M.subspace_similarity(x, y @ rot, k=k, space="images") == pytest.approx(images, rel=1e-8)
    rotated = M.subspace_similarity(x, y @ rot, k=k, space="features")
    assert rotated == pytest.approx(feature_reference(x, y @ rot, k), rel=1e-8)
    assert abs(rotated - feats) > 0.1


def test_the_features_variant_on_a_tiny_pair_has_its_column_an_interval_and_no_null():
    """Two tiny models of the same width under the default 'auto': feature-space values and jackknife errors equal
    the direct computation on extracted features; no permutation null (the value ignores B's image order); with
    'images' asked the same pair gets the images variant and its null."""
    vm_a, vm_b = tiny("vit"), tiny("vit", seed=5)
    vm_a.name, vm_b.name = "A", "B"
    batches = list(SyntheticShapes(n=N, seed=2).batches(6, vm_a.preprocessing))
    k, groups = 4, 4
    params = dict(measures=["subspace_similarity", "mean_cca"], subspace_k=k, n_subset=100, n_permutations=99,
                  n_groups=groups, null_pairs="matched")
    a, b = _run(vm_a, batches, **params), _run(vm_b, batches, **params)
    cross = type(a).cross([a, b])
    sub = cross[cross.metric == "subspace_similarity"]
    assert len(sub) == 3 and (sub.subspace_space == "features").all()
    assert cross[cross.metric == "mean_cca"].subspace_space.isna().all()  # the column is the subspace rows'
    assert sub.p_value.isna().all() and sub.null_mean.isna().all()  # no null for the feature-space variant
    assert cross[cross.metric == "mean_cca"].p_value.notna().all()  # the other measures keep theirs
    images = torch.cat([x.images for x in batches])
    order = a.ids.numpy()
    taps = [f"block{i}.out" for i in range(3)]
    fa, fb = extract(vm_a, images, taps, view="gap"), extract(vm_b, images, taps, view="gap")
    for t in taps:
        row = sub[sub.tap == t].iloc[0]
        xa, xb = (f[t].half().double().numpy()[order] for f in (fa, fb))
        assert row.value == pytest.approx(feature_reference(xa, xb, k), rel=1e-6, abs=1e-9), t
        keep = [np.arange(N) % groups != g for g in range(groups)]
        reps = np.array([feature_reference(xa[m], xb[m], k) for m in keep])
        se = np.sqrt((groups - 1) / groups * ((reps - reps.mean()) ** 2).sum())
        assert row.stderr == pytest.approx(se, rel=1e-4, abs=1e-7), t
        assert 0.0 <= row.value_lo <= row.value <= row.value_hi <= 1.0
    for an in (a, b):
        an.subspace_space = "images"
    again = type(a).cross([a, b])
    sub = again[again.metric == "subspace_similarity"]
    assert (sub.subspace_space == "images").all() and sub.p_value.notna().all()
    for t in taps:
        xa, xb = (f[t].half().double().numpy()[order] for f in (fa, fb))
        assert sub[sub.tap == t].value.item() == pytest.approx(reference(xa, xb, k), rel=1e-6, abs=1e-9)
