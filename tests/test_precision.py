"""bf16 forwards: the taps reach every analysis as float32 and the analyses accumulate in float32 / float64,
so a bf16 study's tables are an fp32 study's up to the rounding of the forward (bfloat16 keeps 8 bits of
mantissa: each product is exact to about 0.4%, and the analyses average many of them)."""

import warnings

import pandas as pd
import pytest

from vitscope.study import load_config, run_study

STUDY = """
models: [{name: zoo-sup}]
dataset: {name: cifar10-test-1k, n_images: 128}
analyses:
  attention_distance: {}
  cka: {}
  svd_volume: {}
  semantics: {}
batch_size: 32
progress: false
"""


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bf16")
    cfg = tmp / "study.yaml"
    cfg.write_text(STUDY)
    out = {}
    for dtype in ("fp32", "bf16"):
        with warnings.catch_warnings():  # small test splits (ResultWarning)
            warnings.simplefilter("ignore")
            run = run_study(load_config(cfg, [f"output_dir={tmp / dtype}", f"cache_dir={tmp / 'cache'}",
                                              f"dtype={dtype}"]))
        out[dtype] = {f.stem: pd.read_parquet(f) for f in (run / "results").glob("*.parquet")}
    return out


def _pair(tables, name, metrics):
    a, b = tables["fp32"][name], tables["bf16"][name]
    a, b = a[a.metric.isin(metrics)].reset_index(drop=True), b[b.metric.isin(metrics)].reset_index(drop=True)
    keys = [c for c in ("metric", "layer", "head", "token_view", "tap", "layer_b", "tap_b", "k") if c in a]
    pd.testing.assert_frame_equal(a[keys], b[keys])  # the same rows, in the same order
    assert len(a)
    return a, b


def test_bf16_tables_are_the_fp32_tables_within_the_rounding_of_the_forward(tables):
    # attention distances (means over images, heads): within 1% of fp32 (measured: 0.04%)
    a, b = _pair(tables, "attention_distance", ["distance", "distance_px"])
    assert ((a.value - b.value).abs() <= 0.01 * a.value.abs()).all()
    # CKA (ratios of Gram sums in float64): within 0.01 (measured: 0.001)
    a, b = _pair(tables, "cka", set(tables["fp32"]["cka"].metric))
    assert ((a.value - b.value).abs() <= 0.01).all()
    # log volumes of the feature spectra: within 0.01 nats (measured: 0.001; the smallest eigenvalues alone are
    # rounding noise in both and are not compared)
    a, b = _pair(tables, "svd_volume", ["image_log_volume", "token_log_volume"])
    assert ((a.value - b.value).abs() <= 0.01).all()
    # accuracies of k-NN and the probe: a few test images flip, within the fp32 row's own 95% interval
    acc = [m for m in set(tables["fp32"]["semantics"].metric) if m.startswith(("knn", "probe")) and "chance" not in m]
    a, b = _pair(tables, "semantics", acc)
    assert ((b.value >= a.value_lo - 1e-9) & (b.value <= a.value_hi + 1e-9)).all()


def test_bf16_forwards_are_in_effect(tables):
    """The comparison above is of two different computations: bf16 changes the numbers."""
    a, b = tables["fp32"]["attention_distance"], tables["bf16"]["attention_distance"]
    assert (a.value - b.value).abs().max() > 0
