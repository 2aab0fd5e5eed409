"""k-NN, probes, clustering and agreement: brute-force references and hand-computed cases."""

import math

import numpy as np
import pytest
import torch

import vitscope as vs
from conftest import tiny
from vitscope.analyses import get_analysis
from vitscope.capture import stream
from vitscope.data import SyntheticShapes
from vitscope.metrics import semantics as S


def _knn_reference(train, ytr, test, yte, k, T=0.07, c=None):
    c = c or int(max(ytr.max(), yte.max())) + 1
    top1 = top5 = 0
    for i in range(len(test)):
        sims = []
        for j in range(len(train)):
            a, b = test[i], train[j]
            sims.append(float(a @ b) / (math.sqrt(float(a @ a)) * math.sqrt(float(b @ b))))
        order = sorted(range(len(train)), key=lambda j: -sims[j])[:k]
        score = [0.0] * c
        for j in order:
            score[int(ytr[j])] += math.exp(sims[j] / T)
        ranked = sorted(range(c), key=lambda q: -score[q])
        top1 += ranked[0] == int(yte[i])
        top5 += int(yte[i]) in ranked[:5]
    return top1 / len(test), top5 / len(test)


@pytest.mark.parametrize("k", [1, 3, 10, 50])
def test_knn_matches_a_brute_force_reference(k):
    g = torch.Generator().manual_seed(k)
    centres = torch.randn(6, 8, generator=g)
    ytr, yte = torch.randint(0, 6, (40,), generator=g), torch.randint(0, 6, (15,), generator=g)
    train = centres[ytr] + 0.8 * torch.randn(40, 8, generator=g)
    test = centres[yte] + 0.8 * torch.randn(15, 8, generator=g)
    got = S.knn_classify(train, ytr, test, yte, ks=(k,))[k]
    ref = _knn_reference(train, ytr, test, yte, min(k, 40))
    assert got[0] == pytest.approx(ref[0])
    if k >= 5:  # with fewer voters than 5 classes, top-5 is decided among zero-score ties
        assert got[1] == pytest.approx(ref[1])


def test_clustering_scores_on_hand_made_cases():
    y = np.array([0, 0, 1, 1])
    assert S.purity(y, np.array([1, 1, 0, 0])) == 1.0
    assert S.purity(y, np.array([0, 1, 0, 1])) == 0.5
    assert S.purity(np.array([0, 0, 0, 1, 1, 2]), np.array([5, 5, 5, 5, 7, 7])) == pytest.approx(4 / 6)
    from sklearn.metrics import adjusted_rand_score

    assert adjusted_rand_score(y, [0, 1, 0, 1]) == pytest.approx(-0.5)  # worked by hand: (0 - 2/3) / (2 - 2/3)
    blobs = np.concatenate([np.random.default_rng(0).normal(m, 0.1, (20, 2)) for m in (0, 5, 10)])
    scores = S.kmeans_scores(blobs, np.repeat([0, 1, 2], 20), k=3)
    assert scores == {"purity": 1.0, "nmi": pytest.approx(1.0), "ari": pytest.approx(1.0)}


def test_linear_probe_separates_separable_data_and_fails_on_noise():
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 3, (300,), generator=g)
    x = torch.randn(300, 10, generator=g)
    x[:, 0] += 4 * y
    acc, logits = S.linear_probe(x[:200], y[:200], x[200:], y[200:])
    assert acc > 0.95 and logits.shape == (100, 3)
    noise = torch.randn(300, 10, generator=g)
    noise_acc, _ = S.linear_probe(noise[:200], y[:200], noise[200:], y[200:])
    assert noise_acc < 0.6


def test_prediction_agreement_extremes():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(30, 12, generator=g)
    labels = logits.argmax(1)
    same = S.prediction_agreement(logits, logits.clone(), labels, ks=(5, 10))
    assert same["kendall_tau_top5_all"] == pytest.approx(1.0) and same["top1_f1"] == pytest.approx(1.0)
    assert math.isnan(same["kendall_tau_top5_incorrect"])  # no image is wrong for both
    flipped = S.prediction_agreement(logits, -logits, labels, ks=(5,))
    assert flipped["kendall_tau_top5_all"] == pytest.approx(-1.0)
    from scipy.stats import kendalltau

    other = torch.randn(30, 12, generator=g)
    top = logits.topk(10, 1).indices
    ref = np.mean([kendalltau(logits[i, top[i]], other[i, top[i]]).statistic for i in range(30)])
    assert S.prediction_agreement(logits, other, labels, ks=(10,))["kendall_tau_top10_all"] == pytest.approx(ref)


def _batches(vm, n=30, bs=10):
    return list(SyntheticShapes(n=n, seed=4).batches(bs, vm.preprocessing))


def test_semantics_from_the_pipeline_equals_direct_computation():
    vm = tiny("vit")
    batches = _batches(vm)
    a = get_analysis("semantics")(vm, layers=[2], views=["gap_spatial"], ks=(5,), kmeans=False)
    stream(vm, batches, [a], progress=False)
    df = a.finalize()
    x = torch.cat([b.images for b in batches])
    y = torch.cat([b.labels for b in batches])
    ids = torch.cat([b.index for b in batches])
    f = vs.extract(vm, x, ["block2.out"], view="gap_spatial")["block2.out"].half().float()
    test = ids % 5 == 0
    t1, t5 = _knn_reference(f[~test], y[~test], f[test], y[test], 5, c=int(y.max()) + 1)
    assert df[df.metric == "knn5_top1"].value.item() == pytest.approx(t1)
    assert df[df.metric == "knn5_top5"].value.item() == pytest.approx(t5)
    assert {"knn5_top1_chance", "probe_top1_chance"} <= set(df.metric)


def test_semantics_merge_and_cap():
    vm = tiny("vit")
    batches = _batches(vm)
    whole = get_analysis("semantics")(vm, kmeans=False, probe=False)
    stream(vm, batches, [whole], progress=False)
    a, b = get_analysis("semantics")(vm, kmeans=False, probe=False), get_analysis("semantics")(vm, kmeans=False,
                                                                                              probe=False)
    stream(vm, batches[:1], [a], progress=False)
    stream(vm, batches[1:], [b], progress=False)
    a.merge(b)
    assert a.finalize().value.to_numpy() == pytest.approx(whole.finalize().value.to_numpy())
    capped = get_analysis("semantics")(vm, max_images=12, kmeans=False, probe=False)
    stream(vm, batches, [capped], progress=False)
    assert capped.n_images == 12 and capped.state_dict()["feats"]["cls"].shape[1] == 12
