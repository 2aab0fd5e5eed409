"""CKA grids, residual CKA and diversity, checked against direct computations on extracted features."""

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vitscope as vs
from conftest import tiny
from vitscope.analyses import get_analysis
from vitscope.capture import stream
from vitscope.data import SyntheticShapes

N, BS = 20, 8  # CKA batches of 8, 8 and a last one of 4


def _images_and_batches(vm, n=N, fwd=6):
    batches = list(SyntheticShapes(n=n, seed=2).batches(fwd, vm.preprocessing))
    return torch.cat([b.images for b in batches]), batches


def _run(name, vm, batches, **params):
    a = get_analysis(name)(vm, **params)
    stream(vm, batches, [a], progress=False)
    return a


def _flat(x):
    return x.reshape(x.shape[0], -1)


def test_sublayer_grid_and_all_token_view():
    vm = tiny("vit")
    x, batches = _images_and_batches(vm)
    a = _run("cka", vm, batches, taps=["block*.norm1", "block*.qkv", "block-1.fc1"], views=["all", "spatial"],
             batch_size=BS)
    df = a.finalize()
    assert a.taps == ["block0.norm1", "block1.norm1", "block2.norm1", "block0.qkv", "block1.qkv", "block2.qkv",
                      "block2.fc1"]
    feats = vs.extract(vm, x, ["block0.qkv", "block2.fc1"])
    ref = vs.cka(feats["block0.qkv"], feats["block2.fc1"], batch_size=BS)  # (N, T, D): all tokens flattened
    got = df[(df.tap == "block0.qkv") & (df.tap_b == "block2.fc1") & (df.token_view == "all")].value.item()
    assert got == pytest.approx(ref, rel=1e-6)
    ref_sp = vs.cka(feats["block0.qkv"][:, 1:], feats["block2.fc1"][:, 1:], batch_size=BS)
    got_sp = df[(df.tap == "block0.qkv") & (df.tap_b == "block2.fc1") & (df.token_view == "spatial")].value.item()
    assert got_sp == pytest.approx(ref_sp, rel=1e-6)


def test_cross_model_last_layer_and_divergence():
    va, vb = tiny("vit"), tiny("vit", seed=5)
    va.name, vb.name = "pre", "ft"
    x, batches = _images_and_batches(va)
    a = _run("cka", va, batches, taps="block-1.out", views="gap", batch_size=BS)
    b = _run("cka", vb, batches, taps="block-1.out", views="gap", batch_size=BS)
    cross = type(a).cross([a, b])
    fa = vs.extract(va, x, "block2.out", view="gap")["block2.out"]
    fb = vs.extract(vb, x, "block2.out", view="gap")["block2.out"]
    ref = vs.cka(fa, fb, batch_size=BS)
    assert cross[cross.metric == "cka_minibatch"].value.item() == pytest.approx(ref, rel=1e-6)
    assert cross[cross.metric == "cka_divergence"].value.item() == pytest.approx(1 - ref, rel=1e-6)
    # stderr by batch means: the CKA of each CKA batch (8, 8, 4 images) alone, numpy's standard error
    per_batch = [vs.cka(fa[s:s + BS], fb[s:s + BS], batch_size=BS) for s in (0, 8, 16)]
    se = np.std(per_batch, ddof=1) / np.sqrt(3)
    for metric in ("cka_minibatch", "cka_divergence"):
        row = cross[cross.metric == metric]
        assert row.stderr.item() == pytest.approx(se, rel=1e-4)
        # Student's t over the 3 batch means (2 degrees of freedom: 4.303), not the normal's 1.96
        assert row.value_hi.item() - row.value_lo.item() == pytest.approx(2 * 4.302653 * se, rel=1e-4)


def test_residual_cka_pairs_skip_path_with_branches():
    vm = tiny("beit")
    x, batches = _images_and_batches(vm)
    df = _run("residual_cka", vm, batches, views=["gap_spatial"], batch_size=BS).finalize()
    f = vs.extract(vm, x, ["embed", "block0.out", "block1.out", "block0.attn_out", "block2.mlp_out"],
                   view="gap_spatial")
    skips = {0: f["embed"], 1: f["block0.out"], 2: f["block1.out"]}
    for i, j, branch in [(0, 0, "attn_out"), (2, 2, "mlp_out"), (1, 0, "attn_out")]:
        ref = vs.cka(skips[i], f[f"block{j}.{branch}"], batch_size=BS)
        got = df[(df.metric == f"skip_vs_{branch}") & (df.layer == i) & (df.layer_b == j)].value.item()
        assert got == pytest.approx(ref, rel=1e-6)
    assert len(df) == 2 * 3 * 3


def test_heads_tap_projects_to_the_attention_branch(images):
    for kind in ("vit", "beit"):
        vm = tiny(kind)
        f = vs.extract(vm, images, ["block1.heads", "block1.attn", "block1.qkv", "block1.attn_out"])
        blk = vm.model.blocks[1]
        gamma = blk.gamma_1 if kind == "beit" else 1.0  # the tiny ViT has no layer scale
        torch.testing.assert_close(F.linear(f["block1.heads"], blk.attn.proj.weight, blk.attn.proj.bias) * gamma,
                                   f["block1.attn_out"], atol=1e-5, rtol=1e-5)
        B, T, _ = f["block1.qkv"].shape
        v = f["block1.qkv"].reshape(B, T, 3, 3, 16)[:, :, 2].transpose(1, 2)  # (B, H, T, hd)
        head1 = (f["block1.attn"] @ v)[:, 1]
        torch.testing.assert_close(f["block1.heads"][..., 16:32], head1, atol=1e-5, rtol=1e-5)


def test_diversity_matches_slow_references():
    vm = tiny("reg")  # 5 prefix tokens: spatial tokens start at 5
    x, batches = _images_and_batches(vm)
    a = _run("diversity", vm, batches, batch_size=BS)
    df = a.finalize()
    f = vs.extract(vm, x, ["embed", "block0.heads", "block0.resid_mid", "block0.out"])
    heads = f["block0.heads"].reshape(N, -1, 3, 16)
    # cosine between heads: loop over images, tokens and head pairs
    tot, cnt = 0.0, 0
    for b in range(N):
        for t in range(heads.shape[1]):
            for h, g in itertools.permutations(range(3), 2):
                tot += float(F.cosine_similarity(heads[b, t, h], heads[b, t, g], dim=0))
                cnt += 1
    assert df[(df.metric == "cosine_heads") & (df.layer == 0)].value.item() == pytest.approx(tot / cnt, rel=1e-5)
    # its stderr over images: the per-image means of the same loop, numpy's standard error
    per_image = [np.mean([float(F.cosine_similarity(heads[b, t, h], heads[b, t, g], dim=0))
                          for t in range(heads.shape[1]) for h, g in itertools.permutations(range(3), 2)])
                 for b in range(N)]
    se = df[(df.metric == "cosine_heads") & (df.layer == 0)].stderr.item()
    assert se == pytest.approx(np.std(per_image, ddof=1) / np.sqrt(N), rel=1e-4)
    # CKA between heads: every ordered pair through vs.cka
    pairs = [vs.cka(_flat(heads[:, :, h]), _flat(heads[:, :, g]), batch_size=BS)
             for h, g in itertools.permutations(range(3), 2)]
    assert df[(df.metric == "cka_heads") & (df.layer == 0)].value.item() == pytest.approx(sum(pairs) / 6, rel=1e-6)
    # tokens: spatial positions of block0.out
    sp = f["block0.out"][:, 5:]
    S = sp.shape[1]
    cos = [float(F.cosine_similarity(sp[b, p], sp[b, q], dim=0))
           for b in range(N) for p, q in itertools.permutations(range(S), 2)]
    assert df[(df.metric == "cosine_tokens") & (df.layer == 0)].value.item() == pytest.approx(
        sum(cos) / len(cos), rel=1e-5)
    sub = [0, 3, 9]  # CKA between positions: check a few pairs against the full mean's ingredients
    for p, q in itertools.permutations(sub, 2):
        ref = vs.cka(sp[:, p], sp[:, q], batch_size=BS)
        assert a._finished().hsic_tokens[0, p, q] / (a._finished().hsic_tokens[0, p, p]
                                                    * a._finished().hsic_tokens[0, q, q]).sqrt() == pytest.approx(
            ref, rel=1e-6)
    # depth: block input vs resid_mid
    ref_depth = vs.cka(f["embed"], f["block0.resid_mid"], batch_size=BS)
    depth = df[(df.metric == "cka_depth") & (df.layer == 0)]
    assert depth.value.item() == pytest.approx(ref_depth, rel=1e-6)
    # stderr by batch means, on the heads: each CKA batch's (8, 8, 4 images) mean CKA over head pairs alone,
    # numpy's standard error of those
    per_batch = [np.mean([vs.cka(_flat(heads[s:s + BS, :, h]), _flat(heads[s:s + BS, :, g]), batch_size=BS)
                          for h, g in itertools.permutations(range(3), 2)]) for s in (0, 8, 16)]
    se = df[(df.metric == "cka_heads") & (df.layer == 0)].stderr.item()
    assert se == pytest.approx(np.std(per_batch, ddof=1) / np.sqrt(3), rel=1e-4) and se > 1e-4
    ref_cos = F.cosine_similarity(f["embed"].double(), f["block0.resid_mid"].double(), dim=-1).mean()
    assert df[(df.metric == "cosine_depth") & (df.layer == 0)].value.item() == pytest.approx(float(ref_cos), rel=1e-6)


@pytest.mark.parametrize("name", ["residual_cka", "diversity"])
def test_merge_equals_one_pass(name):
    vm = tiny("vit")
    _, batches = _images_and_batches(vm, n=24, fwd=8)
    whole = _run(name, vm, batches, batch_size=8).finalize()
    first = _run(name, vm, batches[:1], batch_size=8)
    first.merge(_run(name, vm, batches[1:], batch_size=8))
    resumed = get_analysis(name)(vm, batch_size=8)
    resumed.load_state_dict(first.state_dict())
    for df in (first.finalize(), resumed.finalize()):
        # the CLS token entering block 0 is the same for every image: its CKA is NaN in both
        assert df.value.to_numpy() == pytest.approx(whole.value.to_numpy(), rel=1e-6, abs=1e-9, nan_ok=True)


def test_gram_groups_shift_only_when_the_mean_matters_and_stay_precise():
    from vitscope.analyses.similarity import GramGroups
    from vitscope.metrics import cka as C

    g = torch.Generator().manual_seed(0)
    base = torch.randn(64, 50, generator=g, dtype=torch.float64)
    other = base @ torch.randn(50, 40, generator=g, dtype=torch.float64) + torch.randn(64, 40, generator=g,
                                                                                      dtype=torch.float64)
    for offset, shifted in ((0.0, False), (1e3, True)):
        groups = GramGroups(16)
        closed = []
        for s in range(0, 64, 16):
            closed += groups.add({"x": (base[s:s + 16] + offset).float(), "y": (other[s:s + 16] + offset).float()},
                                 torch.arange(s, s + 16))
        assert (groups.ref["x"] is not None) == shifted
        got = C.cka_from_gram_list([c[1]["x"][None] for c in closed], [c[1]["y"][None] for c in closed]).item()
        ref = C.minibatch_cka(base, other, batch_size=16)  # float64, no offset: HSIC_1 is shift-invariant
        assert got == pytest.approx(ref, rel=1e-5)


def _fake_vm(name="m", depth=3):
    from types import SimpleNamespace

    return SimpleNamespace(name=name, depth=depth, num_heads=1, grid_size=(2, 2), patch_size=16, num_prefix_tokens=1,
                           has_cls_token=True)


def _layer_feats(n, tokens, dim, depth=3, offset=0.0, seed=0):
    """(N, T, D) float32 features per layer: a random walk over layers, plus a common offset."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, tokens, dim, generator=g, dtype=torch.float64)
    out = []
    for _ in range(depth):
        x = x + 0.7 * torch.randn(n, tokens, dim, generator=g, dtype=torch.float64)
        out.append((x + offset).float())
    return out


def _feed(analysis, feats, order, fwd):
    """Forward batches of `fwd` images, in the order of the image ids `order`."""
    from vitscope.data.base import Batch

    for s in range(0, len(order), fwd):
        idx = torch.as_tensor(order[s:s + fwd])
        analysis.update({f"block{i}.out": f[idx] for i, f in enumerate(feats)}, Batch(images=idx, index=idx))
    return analysis


def _ref_minibatch_cka_f64(xs, ys, bs):
    """Independent float64 minibatch CKA (numpy): literal HSIC_1 on consecutive batches of `bs` (the last kept
    if it has >= 4 examples), equal weight per batch; xs, ys: lists of (N, F) arrays."""
    import numpy as np

    def hsic(K, L):
        n = len(K)
        K, L = K - np.diag(np.diag(K)), L - np.diag(np.diag(L))
        one = np.ones(n)
        return (np.trace(K @ L) + (one @ K @ one) * (one @ L @ one) / ((n - 1) * (n - 2))
                - 2 / (n - 2) * (one @ K @ L @ one)) / (n * (n - 3))

    N = len(xs[0])
    bounds = [(s, min(s + bs, N)) for s in range(0, N, bs) if min(s + bs, N) - s >= 4]
    out = np.empty((len(xs), len(ys)))
    for a, x in enumerate(xs):
        for c, y in enumerate(ys):
            kl = kk = ll = 0.0
            for s, e in bounds:
                K, L = x[s:e] @ x[s:e].T, y[s:e] @ y[s:e].T
                kl, kk, ll = kl + hsic(K, L), kk + hsic(K, K), ll + hsic(L, L)
            out[a, c] = kl / np.sqrt(kk * ll)
    return out


@pytest.mark.parametrize("offset", [0.0, 10.0])
def test_cka_gram_cache_all_tokens_with_large_mean_matches_float64_reference(offset):
    from vitscope.analyses.similarity import CKA
    from vitscope.metrics import cka as C

    n, tokens, dim = 44, 9, C.CHUNKED_GRAM_MIN_FEATURES // 9 + 11  # all-token view goes through the chunked kernel
    feats = _layer_feats(n, tokens, dim, offset=offset)
    ref_all = _ref_minibatch_cka_f64([f.double().reshape(n, -1).numpy() for f in feats],
                                     [f.double().reshape(n, -1).numpy() for f in feats], 16)
    ref_cls = _ref_minibatch_cka_f64([f[:, 0].double().numpy() for f in feats],
                                     [f[:, 0].double().numpy() for f in feats], 16)
    errs = []
    for fwd in (16, 7):  # whole CKA batches used in place / rows waiting for their group
        a = _feed(CKA(_fake_vm(), taps="block*.out", views=["all", "cls"], batch_size=16), feats, list(range(n)), fwd)
        assert all(g.dtype == torch.float32 for gs in a.grams.values() for g in gs)
        assert (a.groups.ref["all|block2.out"] is not None) == (offset > 0)  # shift only when the mean matters
        got_all, got_cls = a.matrix("all").numpy(), a.matrix("cls").numpy()
        errs += [np.abs(got_all - ref_all).max(), np.abs(got_cls - ref_cls).max()]
        np.testing.assert_array_equal(got_all, got_all.T)
    assert max(errs) < 1e-6
    if offset:  # the same float32 Grams without the shift lose digits: the reference can tell the difference
        naive = [[C.gram_matrix(f.reshape(n, -1)[s:s + 16]) for s in (0, 16, 32)] for f in feats]
        assert np.abs(C.cka_from_gram_streams(naive).numpy() - ref_all).max() > 10 * max(errs)


def test_cka_independent_of_arrival_order_shards_and_resume():
    from vitscope.analyses.similarity import CKA

    n = 48
    feats = _layer_feats(n, 5, 24, offset=3.0, seed=1)
    other = _layer_feats(n, 5, 24, offset=-2.0, seed=2)

    def make(name):
        return CKA(_fake_vm(name), taps="block*.out", views=["gap", "all"], batch_size=8)

    whole = _feed(make("a"), feats, list(range(n)), 8)
    perm = [int(i) for i in torch.randperm(n // 8, generator=torch.Generator().manual_seed(3))]
    shuffled = _feed(make("a"), feats, [b * 8 + j for b in perm for j in range(8)], 8)  # same batches, other order
    first = _feed(make("a"), feats, list(range(24)), 8)
    first.merge(_feed(make("a"), feats, list(range(24, n)), 8))
    resumed = make("a")
    resumed.load_state_dict(first.state_dict())
    b_whole = _feed(make("b"), other, list(range(n)), 8)
    b_shuffled = _feed(make("b"), other, [b * 8 + j for b in perm for j in range(8)], 8)
    for view in ("gap", "all"):
        ref = whole.matrix(view).numpy()
        for got in (shuffled, first, resumed):
            np.testing.assert_allclose(got.matrix(view).numpy(), ref, rtol=0, atol=2e-7)
        cross = whole.matrix(view, b_whole).numpy()
        np.testing.assert_allclose(whole.matrix(view, b_shuffled).numpy(), cross, rtol=0, atol=2e-7)
        np.testing.assert_allclose(cross, _ref_minibatch_cka_f64(_f64(feats, view), _f64(other, view), 8), atol=1e-6)


def _f64(feats, view):
    """float64 (N, F) features of a token view ('gap' or 'all')."""
    return [(f.double().mean(1) if view == "gap" else f.double()).reshape(len(f), -1).numpy() for f in feats]


def _gram_groups_reference(streams: dict, n: int) -> list[dict]:
    """The groups' Grams by the rule, one group at a time: each stream shifted by its first group's mean when
    that mean holds at least 10 % of the first group's energy (read with Python numbers), else not."""
    total = len(next(iter(streams.values())))
    out, ref = [], {}
    for s in range(0, total, n):
        grams = {}
        for k, x in streams.items():
            x = x[s:s + n].float()
            if k not in ref:
                plain = x @ x.T
                m = plain.shape[-1]
                mean_energy = float(plain.sum()) / (m * m)
                ref[k] = x.mean(0) if mean_energy >= 0.1 * float(plain.diagonal().sum()) / m else None
            grams[k] = x @ x.T if ref[k] is None else (x - ref[k]) @ (x - ref[k]).T
        out.append(grams)
    return out, ref


def test_gram_groups_read_the_host_once_per_batch_and_decide_shifts_on_the_device():
    """Several groups closed by the first batch (the shift decision still on the device), a state saved and
    loaded before the decision was read, then more batches: the Grams of the rule, one host read per add."""
    from host_syncs import HostSyncs

    from vitscope.analyses.similarity import GramGroups

    g = torch.Generator().manual_seed(3)
    streams = {"plain": torch.randn(130, 12, generator=g), "offset": torch.randn(130, 12, generator=g) + 5.0}
    want, shifted = _gram_groups_reference(streams, 16)
    assert shifted["plain"] is None and shifted["offset"] is not None  # one stream of each kind
    sizes = [40, 8, 27, 55]  # the first batch closes two groups; the last leaves an open one (flushed)
    groups, got, at = GramGroups(16), [], 0
    for i, b in enumerate(sizes):
        if i == 1:  # the shift decisions are still undecided here: the state reads them
            saved = groups.state_dict()
            assert saved["ref"]["plain"] is None and saved["ref"]["offset"] is not None
            groups = GramGroups(16)
            groups.load_state_dict(saved)
        with HostSyncs() as s:
            got += groups.add({k: x[at:at + b] for k, x in streams.items()}, torch.arange(at, at + b),
                              torch.arange(at, at + b))
        assert s.count <= 1, dict(s.where)
        at += b
    got += groups.flush()
    assert [len(ids) for ids, _ in got] == [16] * 8 + [2]
    assert torch.equal(torch.cat([ids for ids, _ in got]), torch.arange(130))
    for (_, have), ref in zip(got, want, strict=True):
        for k in streams:
            assert torch.allclose(have[k], ref[k], rtol=1e-5, atol=1e-4)
    assert groups.ref["plain"] is None and groups.ref["offset"] is not None


@pytest.mark.parametrize("name", ["cka", "diversity"])
def test_a_state_saved_on_the_host_goes_on_on_the_features_device(name):
    """A state loaded on the CPU meets features on another device (here 'meta', which refuses to mix with CPU
    tensors, standing in for a GPU): the sums, references and open rows move there; nothing stays behind."""
    vm = tiny("vit")
    _, batches = _images_and_batches(vm, n=20, fwd=5)
    first = _run(name, vm, batches[:2], batch_size=8)  # 10 images: an open group of 2 rows, a reference
    a = get_analysis(name)(vm, batch_size=8)
    a.load_state_dict(first.state_dict())
    taps = a.required_taps()
    for b in batches[2:]:
        feats = vs.extract(vm, b.images, taps)
        a.update({t: f.to("meta") for t, f in feats.items()}, b)
    if name == "diversity":
        assert all(getattr(a, k).device.type == "meta" for k in a._TENSORS)
    else:
        assert all(g[-1].device.type == "meta" for g in a.grams.values())
    assert all(x.device.type == "meta" for x in a.groups.pending.values())
