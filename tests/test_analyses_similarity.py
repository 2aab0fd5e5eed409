"""CKA grids, residual CKA and diversity, checked against direct computations on extracted features."""

import itertools

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
    assert df[(df.metric == "cka_depth") & (df.layer == 0)].value.item() == pytest.approx(ref_depth, rel=1e-6)
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
