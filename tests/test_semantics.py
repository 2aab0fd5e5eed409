"""k-NN, probes, clustering and agreement: brute-force references and hand-computed cases."""

import math

import numpy as np
import pytest
import torch

import vitscope as vs
from conftest import TINY, tiny
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
        ranked = [q for q in sorted(range(c), key=lambda q: -score[q]) if score[q] > 0]  # only voted classes
        top1 += ranked[0] == int(yte[i])
        top5 += int(yte[i]) in ranked[:5]
    return top1 / len(test), top5 / len(test)


def _split_reference(ids, labels, every):
    """The stratified split, written out: per class, its rows by id; the 1st, (every+1)-th, ... are test rows,
    unless the class has one row."""
    test = [False] * len(ids)
    for c in set(labels.tolist()):
        rows = sorted((int(ids[i]), i) for i in range(len(ids)) if int(labels[i]) == c)
        for r, (_, i) in enumerate(rows):
            test[i] = len(rows) > 1 and r % every == 0
    return torch.tensor(test)


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
    assert got[1] == pytest.approx(ref[1])  # a class nobody voted for is never predicted, also with k < 5


def test_knn_top5_never_fills_up_with_classes_nobody_voted_for():
    """Two voting classes out of 10: the top 5 holds those two only, whatever order the zero-score classes
    come in (the kernel's tie order made the same study differ between a GPU and a CPU)."""
    train = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0]])
    ytr = torch.tensor([2, 2, 7])
    test = torch.tensor([[1.0, 0.05], [1.0, 0.05], [0.1, 1.0]])
    yte = torch.tensor([2, 0, 3])  # a hit, a class nobody voted for (index 0: first in any tie order), another
    top1, top5 = S.knn_classify(train, ytr, test, yte, ks=(3,), num_classes=10)[3]
    assert top1 == pytest.approx(1 / 3) and top5 == pytest.approx(1 / 3)


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
    # k = 5, and k = every training image, so that top-5 has no ties among classes without votes
    a = get_analysis("semantics")(vm, layers=[2], views=["gap_spatial"], ks=(5, 30), kmeans=False)
    stream(vm, batches, [a], progress=False)
    df = a.finalize()
    x = torch.cat([b.images for b in batches])
    y = torch.cat([b.labels for b in batches])
    ids = torch.cat([b.index for b in batches])
    f = vs.extract(vm, x, ["block2.out"], view="gap_spatial")["block2.out"].half().float()
    test = _split_reference(ids, y, 5)
    t1, _ = _knn_reference(f[~test], y[~test], f[test], y[test], 5, c=int(y.max()) + 1)
    assert df[df.metric == "knn5_top1"].value.item() == pytest.approx(t1)
    t1, t5 = _knn_reference(f[~test], y[~test], f[test], y[test], 30, c=int(y.max()) + 1)
    assert df[df.metric == "knn30_top1"].value.item() == pytest.approx(t1)
    assert df[df.metric == "knn30_top5"].value.item() == pytest.approx(t5)
    assert (df.n_test == int(test.sum())).all() and (df.n_train == int((~test).sum())).all()
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
    assert capped.n_images == len(capped.tables["cls"]) == len(capped.state_dict()["tables"]["cls"]["ids"]) == 12


# --- pooled-feature store, region pooling, dataset split, a trained model beats chance -------------------------------


def test_pooled_table_grows_round_trips_through_a_mapped_file_and_stores_exactly_its_rows(tmp_path):
    from vitscope.analyses.pooled import PooledTable

    g = torch.Generator().manual_seed(0)
    t = PooledTable(2)
    chunks = [(torch.randn(n, 24, generator=g), torch.randn(n, 24, generator=g)) for n in (700, 900, 3)]
    for k, (a, b) in enumerate(chunks):  # 1603 rows: past the first capacity (1024) once
        ids = torch.arange(len(a)) + 10_000 * k
        t.append([a, b], ids, ids % 7, ids % 3 == 0)
    assert len(t) == 1603
    for j in range(2):
        assert torch.equal(t.layer(j), torch.cat([c[j] for c in chunks]).half())
    state = t.state_dict()
    assert all(x.untyped_storage().nbytes() == 1603 * 24 * 2 for x in state["layers"])  # no spare capacity saved
    torch.save(state, tmp_path / "s.pt")
    back = PooledTable.from_state(torch.load(tmp_path / "s.pt", mmap=True))
    assert torch.equal(back.layer(1), t.layer(1)) and torch.equal(back.column("is_test"), t.column("is_test"))
    assert torch.equal(back.column("labels"), torch.cat([(torch.arange(len(c[0])) + 10_000 * k) % 7
                                                         for k, c in enumerate(chunks)]))
    # read back (as a cached rerun or a resume does), then grown: the new rows follow, the file read is untouched
    saved = (tmp_path / "s.pt").read_bytes()
    extra = torch.randn(5, 24, generator=g)
    back.append([extra, extra], torch.arange(5) + 90_000, torch.zeros(5, dtype=torch.long), torch.ones(5) > 0)
    assert len(back) == 1608 and torch.equal(back.layer(0)[:1603], t.layer(0))
    assert torch.equal(back.layer(1)[1603:], extra.half()) and back.column("is_test")[-5:].all()
    assert (tmp_path / "s.pt").read_bytes() == saved


def _region_reference(spatial, maps, grid, min_tokens):
    """Loops: each region's share of each token's pixels, weighted mean of the tokens."""
    h, w = grid
    B, H, W = maps.shape
    ph, pw = H // h, W // w
    out = []
    for b in range(B):
        for r in sorted(set(maps[b].unique().tolist()) - {0}):
            wts = torch.zeros(h * w, dtype=torch.float64)
            for i in range(h):
                for j in range(w):
                    wts[i * w + j] = (maps[b, i * ph:(i + 1) * ph, j * pw:(j + 1) * pw] == r).double().mean()
            if wts.sum() < min_tokens:
                continue
            out.append((b, r, (wts[:, None] * spatial[b].double()).sum(0) / wts.sum()))
    return out


@pytest.mark.parametrize("min_tokens", [0.5, 2.0])
def test_region_pool_equals_a_loop_over_pixels(min_tokens):
    from vitscope.capture.views import region_pool, region_weights

    g = torch.Generator().manual_seed(1)
    grid, B = (3, 4), 4
    maps = torch.randint(0, 5, (B, 3 * 6, 4 * 6), generator=g)
    maps[1] = 0  # an image without regions
    maps[2, :6, :6] = 9  # one region exactly one token
    spatial = torch.randn(B, 12, 8, generator=g)
    vecs, rows, ids = region_pool(spatial, *region_weights(maps, grid, min_tokens))
    ref = _region_reference(spatial, maps, grid, min_tokens)
    assert [(int(b), int(r)) for b, r in zip(rows, ids, strict=True)] == [(b, r) for b, r, _ in ref]
    for v, (_, _, rv) in zip(vecs, ref, strict=True):
        assert torch.allclose(v.double(), rv, atol=1e-5)


def test_object_and_part_views_pool_masks_and_label_parts_by_their_id():
    from vitscope.capture.views import region_pool, region_weights
    from vitscope.data.synthetic import PART_NAMES

    vm = tiny("vit")
    batches = _batches(vm, n=20)
    a = get_analysis("semantics")(vm, layers=[1], views=["object", "part"], ks=(5,), kmeans=False, probe=False)
    stream(vm, batches, [a], progress=False)
    x = torch.cat([b.images for b in batches])
    f = vs.extract(vm, x, ["block1.out"], view="spatial")["block1.out"]
    masks, parts = torch.cat([b.masks for b in batches]), torch.cat([b.parts for b in batches])
    obj = _region_reference(f, masks.long(), vm.grid_size, 0.5)
    assert torch.allclose(a.tables["object"].layer(0).double(), torch.stack([v for *_, v in obj]).half().double())
    labels = torch.cat([b.labels for b in batches])
    assert torch.equal(a.tables["object"].column("labels"), labels[[b for b, *_ in obj]])
    prt = _region_reference(f, parts, vm.grid_size, 0.5)
    assert len(prt) > len(obj)  # several parts per object
    assert a.tables["part"].column("labels").tolist() == [r for _, r, _ in prt]
    assert 0 < a.tables["part"].column("labels").max() <= len(PART_NAMES)
    v, _, _ = region_pool(f, *region_weights(parts, vm.grid_size))
    assert torch.allclose(a.tables["part"].layer(0).float(), v.half().float())
    df = a.finalize()
    assert set(df.token_view) == {"object", "part"} and (df.metric == "knn5_top1_chance").sum() == 2


def test_the_datasets_own_split_is_the_test_split(tmp_path):
    from PIL import Image

    from vitscope.data.loaders import ImageFolder

    rng = np.random.default_rng(0)
    for split, n in (("train", 6), ("test", 2)):
        for c in ("a", "b"):
            (tmp_path / split / c).mkdir(parents=True)
            for i in range(n):
                img = rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)
                Image.fromarray(img).save(tmp_path / split / c / f"{i}.png")
    ds = ImageFolder(tmp_path)
    assert len(ds) == 16 and ds.is_test == [False] * 12 + [True] * 4 and ds.classes == ["a", "b"]
    vm = tiny("vit")
    a = get_analysis("semantics")(vm, layers=[0], views=["gap"], ks=(3,), kmeans=False, probe=False)
    stream(vm, ds.batches(5, vm.preprocessing), [a], progress=False)
    assert a.tables["gap"].column("is_test").tolist() == ds.is_test
    assert a.finalize().n_test.unique().tolist() == [4]


def _knn10_cls(vm, data):
    a = get_analysis("semantics")(vm, views=["cls"], ks=(10,), kmeans=False)
    stream(vm, data.batches(50, vm.preprocessing), [a], progress=False)
    df = a.finalize()
    return df[df.metric == "knn10_top1"].set_index("layer").value, df


def test_a_briefly_trained_model_beats_chance_at_every_layer():
    """300 supervised steps on the texture-bound synthetic classes: every layer's k-NN leaves the Gaussian
    chance row behind, and the last block gains clearly over the untrained network (whose early blocks already
    tell textures apart: with the stratified split the trained model's blocks 0-1 are within 0.02-0.07 of it; no block
    loses). (1,536 training images: with 384 the model overfits and the margins depended on the CPU's floating-point
    path; 240 test images: at 120, layer 0's interval touched chance on an AVX-512 CPU, 1.5 standard errors.)"""
    torch.manual_seed(0)
    vm = tiny("vit", num_classes=12)
    held_out = SyntheticShapes(n=1200, seed=12, variant="texture-bound")  # 240 test images
    before, _ = _knn10_cls(vm, held_out)
    train = SyntheticShapes(n=1536, seed=11, variant="texture-bound")
    batches = list(train.batches(128, vm.preprocessing))
    x, y = torch.cat([b.images for b in batches]), torch.cat([b.labels for b in batches])
    opt = torch.optim.AdamW(vm.model.parameters(), lr=1e-3)
    vm.model.train()
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        i = torch.randint(0, len(x), (64,), generator=g)
        loss = torch.nn.functional.cross_entropy(vm.model(x[i]), y[i])
        opt.zero_grad()
        loss.backward()
        opt.step()
    vm.model.eval()
    after, df = _knn10_cls(vm, held_out)
    chance = max(df[df.metric == "knn10_top1_chance"].value.item(), 1 / 12)
    lo = df[df.metric == "knn10_top1"].set_index("layer").value_lo
    # every layer's 95 % interval above chance
    assert len(after) == vm.depth and (lo > chance).all() and (after > chance + 0.06).all(), (chance, after, lo)
    assert after.iloc[-1] > before.iloc[-1] + 0.1 and (after > before - 0.02).all(), (before, after)
    assert df[(df.metric == "probe_top1") & (df.layer == vm.depth - 1)].value.item() > \
        df[df.metric == "probe_top1_chance"].value.item() + 0.1


def test_probes_of_many_layers_equal_one_at_a_time_and_absent_classes_are_never_predicted():
    g = torch.Generator().manual_seed(5)
    n = 300
    y = torch.randint(0, 4, (n,), generator=g)
    centres = torch.randn(4, 80, generator=g)
    sets = [s * centres[y] + torch.randn(n, 80, generator=g) for s in (0.0, 0.3, 1.0)]
    test = torch.arange(n) % 4 == 0
    accs, scores = S.linear_probes([x[~test] for x in sets], y[~test], [x[test] for x in sets], y[test],
                                   num_classes=6)
    assert scores.shape == (3, int(test.sum()), 6)
    for i in range(3):
        acc, sc = S.linear_probe(sets[i][~test], y[~test], sets[i][test], y[test], num_classes=6)
        assert accs[i] == acc and torch.equal(sc, scores[i])
    assert accs[0] < 0.4 < 0.9 < accs[2]
    assert (scores.argmax(2) < 4).all()  # classes 4 and 5 were never seen in training
    assert (scores[..., 4:] < scores[..., :4].min(2, keepdim=True).values).all()


def test_probes_and_kmeans_run_on_the_sources_views_knn_on_all():
    vm = tiny("vit")
    views = ["cls", "gap", "gap_spatial", "object", "part"]

    def ran(**kw):
        a = get_analysis("semantics")(vm, layers=[1], views=views, ks=(3,), **kw)
        stream(vm, _batches(vm, n=30), [a], progress=False)
        df = a.finalize()
        return {m: set(df[df.metric == m].token_view) for m in ("knn3_top1", "probe_top1", "kmeans_purity")}

    default = ran()
    assert default["knn3_top1"] == set(views)
    assert default["probe_top1"] == {"cls", "gap_spatial"}
    assert default["kmeans_purity"] == {"cls", "gap_spatial", "object", "part"}
    every = ran(probe=True, kmeans=["gap"])
    assert every["probe_top1"] == set(views) and every["kmeans_purity"] == {"gap"}
    assert ran(probe=False, kmeans=False)["probe_top1"] == set()


def test_cross_model_agreement_pairs_every_model_and_fits_each_probe_once(monkeypatch):
    vms = [vs.load_model("vit_small_patch16_224", pretrained=False, seed=s, **TINY) for s in (0, 1, 2)]
    batches = _batches(vms[0], n=40)
    parts = []
    for k, vm in enumerate(vms):
        vm.name = f"m{k}"
        a = get_analysis("semantics")(vm, views=["cls"], ks=(5,), kmeans=False)
        stream(vm, batches, [a], progress=False)
        parts.append(a)
    direct = {a.model_name: a.probe_logits("cls", a.layers[-1]) for a in parts}
    calls = []
    original = type(parts[0]).probe_logits

    def counted(self, view, layer):
        calls.append(self.model_name)
        return original(self, view, layer)

    monkeypatch.setattr(type(parts[0]), "probe_logits", counted)
    df = type(parts[0]).cross(parts)
    assert sorted(calls) == ["m0", "m1", "m2"]
    assert set(zip(df.model, df.model_b, strict=True)) == {("m0", "m1"), ("m0", "m2"), ("m1", "m2")}
    for (ma, mb), g in df.groupby(["model", "model_b"]):
        (la, y, _), (lb, _, _) = direct[ma], direct[mb]
        want = S.prediction_agreement(la, lb, y)
        got = g.set_index("metric").value
        for k, v in want.items():
            assert got[k] == pytest.approx(v, nan_ok=True), k


# --- results that cannot mean much say so ---------------------------------------------------------------------------


def _warnings_of(fn):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def test_one_class_fewer_test_images_than_classes_and_a_one_class_probe_warn(tmp_path):
    from PIL import Image

    from vitscope.data.loaders import ImageFolder

    vm = tiny("vit")
    rng = np.random.default_rng(0)
    (tmp_path / "only").mkdir()
    for i in range(12):
        Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(tmp_path / "only" / f"{i}.png")
    a = get_analysis("semantics")(vm, layers=[0, 1], views=["gap"], ks=(3,))
    stream(vm, ImageFolder(tmp_path).batches(6, vm.preprocessing), [a], progress=False)
    df, said = _warnings_of(a.finalize)
    assert (df[df.metric == "knn3_top1"].value == 1.0).all()  # what it computes: chance is 1.0 here
    assert len(said) == 1 and "same label" in said[0] and "'gap'" in said[0]  # once, not per layer or per score

    # 12 shape classes in 15 images: no class has two test images, the classes of one image have no test image
    a = get_analysis("semantics")(vm, layers=[0], views=["cls"], ks=(3,), kmeans=False, probe=False)
    stream(vm, _batches(vm, n=15, bs=5), [a], progress=False)
    _, said = _warnings_of(a.finalize)
    assert len(said) == 1 and "fewer than 2 test images" in said[0] and "'cls'" in said[0]
    _, said = _warnings_of(lambda: get_analysis("semantics")(vm, layers=[0], views=["cls"], ks=(3,)).finalize())
    assert said == []  # nothing to score, nothing to warn about

    x = torch.randn(8, 4)
    (acc, _), said = _warnings_of(lambda: S.linear_probe(x[:6], torch.zeros(6, dtype=torch.long), x[6:],
                                                          torch.tensor([0, 1])))
    assert acc == 0.5 and len(said) == 1 and "linear probe" in said[0] and "1 class" in said[0]
    _, said = _warnings_of(lambda: S.linear_probes([x[:6]] * 3, torch.zeros(6, dtype=torch.long), [x[6:]] * 3,
                                                   torch.tensor([0, 1])))
    assert len(said) == 1  # once for all the layers


def test_kendall_tau_b_of_rows_equals_scipy_row_by_row_with_ties_and_constant_rows():
    """prediction_agreement's per-image Kendall tau (vectorised) against scipy.stats.kendalltau one row at a time,
    on scores with many ties, a constant row on either side and both, and k = 1."""
    import numpy as np
    from scipy.stats import kendalltau

    from vitscope.metrics.semantics import kendall_tau_b_rows

    g = torch.Generator().manual_seed(3)
    for k in (1, 2, 5, 10, 37):
        a = torch.randint(0, 4, (300, k), generator=g).double()  # few values: ties in most rows
        b = torch.randn(300, k, generator=g, dtype=torch.float64)
        b[::7] = torch.randint(0, 3, (len(b[::7]), k), generator=g).double()
        a[1], b[2], a[3], b[3] = 1.0, 2.0, 0.0, 0.0  # constant rows
        got = kendall_tau_b_rows(a, b, chunk=64).numpy()
        want = np.array([kendalltau(x, y).statistic for x, y in zip(a.numpy(), b.numpy(), strict=True)], dtype=float)
        assert np.array_equal(np.isnan(got), np.isnan(want)), k
        np.testing.assert_allclose(got[~np.isnan(want)], want[~np.isnan(want)], rtol=0, atol=1e-12)


def test_pooled_rows_of_several_tables_reach_the_host_in_one_copy():
    """`to_host` + `PooledTable.append_host` (what semantics does per batch) store what `append` stores, with
    at most one host synchronisation for all the tables (none on the CPU, where the rows already are)."""
    from host_syncs import HostSyncs

    from vitscope.analyses.pooled import PooledTable
    from vitscope.host import to_host

    g = torch.Generator().manual_seed(0)
    feats = [[torch.randn(5, 6, generator=g) for _ in range(3)] for _ in range(2)]  # 2 tables x 3 layers
    ids, labels, is_test = torch.arange(5), torch.randint(0, 3, (5,), generator=g), torch.rand(5, generator=g) > 0.5
    one = [PooledTable(3), PooledTable(3)]
    for t, f in zip(one, feats, strict=True):
        t.append(f, ids, labels, is_test)
    many = [PooledTable(3), PooledTable(3)]
    with HostSyncs() as s:
        *flat, i, y, te = to_host(*(x.half() for f in feats for x in f), ids, labels, is_test)
        for n, t in enumerate(many):
            t.append_host(flat[3 * n:3 * n + 3], i, y, te)
    assert s.count <= 1, dict(s.where)
    for a, b in zip(one, many, strict=True):
        for j in range(3):
            assert torch.equal(a.layer(j), b.layer(j))
        for c in ("ids", "labels", "is_test"):
            assert torch.equal(a.column(c), b.column(c))


def test_region_rows_are_region_pool_with_the_padding_dropped_on_the_host():
    from vitscope.analyses.semantics import _region_rows
    from vitscope.capture.views import region_pool, region_weights, token_view

    g = torch.Generator().manual_seed(1)
    maps = torch.randint(0, 4, (3, 8, 8), generator=g)
    maps[1] = 0  # an image without regions
    weights, ids = region_weights(maps, (4, 4))
    x = [torch.randn(3, 17, 5, generator=g) for _ in range(2)]
    rows = _region_rows(x, weights, 1)
    valid = ids.reshape(-1) > 0
    for f, r in zip(x, rows, strict=True):
        want, image, region = region_pool(token_view(f, "spatial", 1), weights, ids)
        assert torch.equal(r[valid], want.half())
    assert torch.equal(torch.arange(3)[:, None].expand_as(ids).reshape(-1)[valid], image)
    assert torch.equal(ids.reshape(-1)[valid], region)


def _probe_data(seed=0, n=120):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    x = torch.randn(n, 9, generator=g)
    x[:, :4] += 1.5 * torch.nn.functional.one_hot(y, 4)
    return x, y


def test_finalize_steps_take_a_device_and_compute_identically_on_the_cpu():
    """k-NN, the probe and k-means with ``device='cpu'``: the numbers of the default call, bit for bit."""
    x, y = _probe_data()
    tr, te = slice(0, 90), slice(90, None)
    assert S.knn_classify(x[tr], y[tr], x[te], y[te], ks=(5, 20), device="cpu") == \
        S.knn_classify(x[tr], y[tr], x[te], y[te], ks=(5, 20))
    assert S.knn_classify(x[tr], y[tr], x[te], y[te], ks=(5, 20), chunk=7) == \
        S.knn_classify(x[tr], y[tr], x[te], y[te], ks=(5, 20))  # the test rows a chunk at a time
    for tune in (False, True):
        a = S.fit_probe(x[tr], y[tr], x[te], y[te], tune=tune, device="cpu")
        b = S.fit_probe(x[tr], y[tr], x[te], y[te], tune=tune)
        assert (a.accuracy, a.weight_decay, a.iterations) == (b.accuracy, b.weight_decay, b.iterations)
        assert torch.equal(a.scores, b.scores)


@pytest.mark.parametrize("tune", [False, True])
def test_the_probes_device_path_solves_the_same_problem(monkeypatch, tune):
    """The path a GPU takes (features, standardisation, rotation and products as float64 tensors), run on the
    CPU: the same fit as the NumPy path up to the rounding of the products."""
    x, y = _probe_data(1)
    want = S.fit_probe(x[:90], y[:90], x[90:], y[90:], tune=tune)
    monkeypatch.setattr(S, "ACCELERATED", ("cuda", "cpu"))
    got = S.fit_probe(x[:90], y[:90], x[90:], y[90:], tune=tune, device="cpu")
    assert got.accuracy == want.accuracy and got.weight_decay == want.weight_decay
    assert abs(got.iterations - want.iterations) <= 2
    assert torch.allclose(got.scores, want.scores, rtol=1e-4, atol=1e-4)
