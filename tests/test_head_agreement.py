"""`head_agreement` (Shekhar et al. 2022 §2.4, Fig. 4): Kendall's tau of two models' top-k class rankings and the
F1 of their top-1 predictions, checked against slow loops written here, symmetric in the pair's order."""

import functools
import itertools
import math
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from vitscope.analyses import get_analysis
from vitscope.data.catalog import build_dataset
from vitscope.errors import ConfigError, ResultWarning
from vitscope.metrics import mechanistic as M
from vitscope.models import load_model
from vitscope.study.config import DatasetConfig

KW = dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3)
TINY = "{img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3, num_classes: 12}"


def sign(x):
    return (x > 0) - (x < 0)


def kendall_tau_b(x, y):
    """Kendall's tau-b by its definition: concordant minus discordant pairs over sqrt of the untied pairs."""
    s = untied_x = untied_y = 0
    for i, j in itertools.combinations(range(len(x)), 2):
        sx, sy = sign(x[i] - x[j]), sign(y[i] - y[j])
        s += sx * sy
        untied_x += sx != 0
        untied_y += sy != 0
    return s / math.sqrt(untied_x * untied_y) if untied_x and untied_y else float("nan")


def slow_tau(a, b, k):
    """Per image: the mean of tau-b on A's top-k classes and on B's top-k classes."""
    out = []
    for ra, rb in zip(a.tolist(), b.tolist(), strict=True):
        taus = []
        for ref in (ra, rb):
            top = sorted(range(len(ref)), key=lambda c: -ref[c])[:k]
            taus.append(kendall_tau_b([ra[c] for c in top], [rb[c] for c in top]))
        out.append((taus[0] + taus[1]) / 2)
    return np.array(out)


def slow_f1(pa, pb):
    """Macro F1 of pb against pa over the classes either predicts, class by class."""
    f1s = []
    for c in sorted(set(pa) | set(pb)):
        tp = sum(1 for x, y in zip(pa, pb, strict=True) if x == c and y == c)
        fp = sum(1 for x, y in zip(pa, pb, strict=True) if x != c and y == c)
        fn = sum(1 for x, y in zip(pa, pb, strict=True) if x == c and y != c)
        f1s.append(2 * tp / (2 * tp + fp + fn))
    return sum(f1s) / len(f1s)


def tie_top(x, rows, n):
    """Rows ``rows`` of ``x`` with their ``n`` largest entries set equal (above the rest): ties inside a top-k with
    k >= n, never across its boundary (where which tied class enters is arbitrary)."""
    for r in rows:
        top = x[r].topk(n).indices
        x[r, top] = x[r].max() + 1


@pytest.mark.parametrize("k", [3, 5, 10, 30])
def test_kendall_tau_equals_the_definition_on_random_logits_with_ties(k):
    g = torch.Generator().manual_seed(k)
    a = torch.randn(40, 12, generator=g)
    b = a + 0.8 * torch.randn(40, 12, generator=g)
    tie_top(a, range(0, 40, 3), 2)  # ties inside the top-k of some images
    tie_top(b, range(1, 40, 5), 3)
    got = M.topk_kendall_tau(a, b, k).numpy()
    want = slow_tau(a, b, min(k, 12))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    np.testing.assert_allclose(M.topk_kendall_tau(b, a, k).numpy(), got, rtol=0, atol=1e-12)  # symmetric


def test_top1_f1_equals_the_class_by_class_definition_and_is_symmetric():
    from sklearn.metrics import f1_score

    g = torch.Generator().manual_seed(3)
    pa = torch.randint(0, 7, (200,), generator=g)
    pb = torch.where(torch.rand(200, generator=g) < 0.6, pa, torch.randint(0, 9, (200,), generator=g))
    f1 = M.top1_f1(pa, pb)
    assert f1 == pytest.approx(slow_f1(pa.tolist(), pb.tolist()), abs=1e-12)
    assert f1 == pytest.approx(f1_score(pa.numpy(), pb.numpy(), average="macro"), abs=1e-12)
    assert M.top1_f1(pb, pa) == pytest.approx(f1, abs=1e-12)
    reps = M.top1_f1_replicates(pa, pb, 10)
    assert reps[0] == pytest.approx(slow_f1(pa[20:].tolist(), pb[20:].tolist()), abs=1e-12)  # block 0 left out


@functools.cache
def tiny(seed, num_classes=12):
    return load_model("vit_small_patch16_224", pretrained=False, seed=seed, num_classes=num_classes, **KW)


@functools.cache
def batches(n=24):
    """The first ``n`` generated images in batches of 8 (every tiny model here has the same preprocessing)."""
    ds = build_dataset(DatasetConfig(name="synthetic-shapes", n_images=n))
    return tuple(ds.batches(8, tiny(0).preprocessing, indices=list(range(n))))


def run(vm_a, vm_b, bs, **params):
    ha = get_analysis("head_agreement")(vm_a.info(), vm_b.info(), **params)
    for b in bs:
        ha.update(vm_a, vm_b, b)
    return ha


def logits(vm, bs):
    with torch.inference_mode():
        return torch.cat([vm.model(b.images) for b in bs]).double()


def test_the_table_equals_the_slow_loops_on_the_models_own_logits_and_is_symmetric():
    vm_a, vm_b = tiny(0), tiny(1)
    vm_a.name, vm_b.name = "a", "b"
    bs = batches()
    la, lb = logits(vm_a, bs), logits(vm_b, bs)
    df = run(vm_a, vm_b, bs).finalize()
    tau = df[df.metric == "kendall_tau"].set_index("k")
    for k in (5, 10, 100):
        per_image = slow_tau(la, lb, min(k, 12))
        assert tau.loc[k, "value"] == pytest.approx(per_image.mean(), abs=1e-9)
        half = tau.loc[k, "value_hi"] - tau.loc[k, "value"]  # t interval over the 24 images
        from scipy.stats import t

        assert half == pytest.approx(t.ppf(0.975, 23) * per_image.std(ddof=1) / math.sqrt(24), rel=1e-6)
    assert tau.loc[100, "k_used"] == 12
    f1 = df[df.metric == "top1_f1"].iloc[0]
    assert f1.value == pytest.approx(slow_f1(la.argmax(1).tolist(), lb.argmax(1).tolist()), abs=1e-12)
    agree = df[df.metric == "top1_agreement"].iloc[0]
    assert agree.value == pytest.approx(float((la.argmax(1) == lb.argmax(1)).double().mean()), abs=1e-12)
    for r in df.itertuples():  # every interval holds its estimate
        assert r.value_lo <= r.value <= r.value_hi, r.metric
    assert set(df.model) == {"a"} and set(df.model_b) == {"b"}
    back = run(vm_b, vm_a, bs).finalize()  # (B, A): the same values
    pd.testing.assert_series_equal(back.value.reset_index(drop=True), df.value.reset_index(drop=True),
                                   check_exact=False, rtol=0, atol=1e-12)


def test_parts_merged_and_a_state_read_back_give_the_same_table():
    vm_a, vm_b = tiny(0), tiny(1)
    bs = batches()
    whole = run(vm_a, vm_b, bs).finalize()
    first, second = run(vm_a, vm_b, bs[2:]), run(vm_a, vm_b, bs[:2])  # parts in the other order
    first.merge(second)
    back = get_analysis("head_agreement")(vm_a.info(), vm_b.info())
    back.load_state_dict(first.state_dict())
    pd.testing.assert_frame_equal(back.finalize(), whole)


def test_a_model_without_a_head_gives_an_empty_table_saying_why():
    vm_a, vm_b = tiny(0), tiny(1, num_classes=0)
    vm_b.name = "headless"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ha = run(vm_a, vm_b, batches(8))
    df = ha.finalize()
    assert df.empty
    reason = ha.empty_reason()
    assert "'headless' has no classification head" in reason and "\n" not in reason
    assert sum(issubclass(w.category, ResultWarning) for w in seen) == 1
    back = get_analysis("head_agreement")(vm_a.info(), vm_b.info())
    back.load_state_dict(ha.state_dict())  # the reason is in the state: a cached table says it too
    assert back.empty_reason() == reason
    with pytest.warns(ResultWarning, match="do not score the same classes"):
        other = run(vm_a, tiny(2, num_classes=10), batches(8))
    assert other.finalize().empty and "do not score the same classes" in other.empty_reason()


@pytest.mark.parametrize("params, message", [
    ({"ks": [1, 5]}, r"head_agreement: ks must be at least 2"),
    ({"f1_groups": 0}, r"head_agreement: f1_groups must be at least 1"),
])
def test_bad_parameters_are_one_sentence(params, message):
    vm = tiny(0)
    with pytest.raises(ConfigError, match=message) as e:
        get_analysis("head_agreement")(vm.info(), vm.info(), **params)
    assert "\n" not in str(e.value)


STUDY = f"""
models:
  - {{name: vit_small_patch16_224, label: a, pretrained: false, kwargs: {TINY}}}
  - {{name: vit_small_patch16_224, label: b, pretrained: false, seed: 1, kwargs: {TINY}}}
dataset: {{name: synthetic-shapes, n_images: 16}}
analyses:
  head_agreement: {{pairs: [[a, b]], ks: [3, 5]}}
batch_size: 8
progress: false
"""


def test_a_study_runs_the_pair_and_draws_its_figure(tmp_path):
    from vitscope.report.figures.mechanistic import head_agreement
    from vitscope.study import load_config, run_study

    p = tmp_path / "study.yaml"
    p.write_text(STUDY)
    over = [f"output_dir={tmp_path / 'run'}", f"cache_dir={tmp_path / 'cache'}"]
    out = run_study(load_config(p, over))
    df = pd.read_parquet(Path(out) / "results" / "head_agreement.parquet")
    assert set(df.metric) == {"kendall_tau", "top1_f1", "top1_agreement"} and set(df.model_b) == {"b"}
    assert sorted(df[df.metric == "kendall_tau"]["k"].astype(int)) == [3, 5]
    calls = []  # a rerun reads the pair back from the cache: no forward
    again = run_study(load_config(p, over), on_batch=lambda m, b: calls.append(m))
    assert calls == []
    pd.testing.assert_frame_equal(pd.read_parquet(Path(again) / "results" / "head_agreement.parquet"), df)
    figs = head_agreement(df)
    assert len(figs) == 1 and "Shekhar" in figs[0][0]
