"""Robustness lenses: band-limited noise, corruptions, shape bias, the 16-class mapping, readouts, bad input."""

import math

import numpy as np
import pandas as pd
import pytest
import torch

from vitscope.analyses._drive import run_passes
from vitscope.analyses.robustness import BandNoise, Corruptions, ShapeBias, head_label_space
from vitscope.data import perturb as P
from vitscope.data.base import Batch
from vitscope.data.synthetic import SyntheticShapes
from vitscope.errors import ConfigError, InputError, VitscopeError
from vitscope.metrics import robustness as R
from vitscope.metrics import semantics as S
from vitscope.metrics.semantics import majority_rate
from vitscope.models.adapter import ModelInfo


# ---------------------------------------------------------------- band-limited noise
@pytest.mark.parametrize("size", [31, 32, 45])
def test_band_noise_lies_in_its_band_with_equal_energy_for_every_band(size):
    x = torch.rand(3, 3, size, size)
    idx = torch.tensor([0, 7, 11])
    rms = []
    for band in range(P.N_BANDS):
        noise = (P.band_noise(x, idx, seed=3, band=band) - x).double()
        power = torch.fft.fft2(noise).abs().pow(2)  # (B, C, H, W)
        fy = torch.fft.fftfreq(size, dtype=torch.float64)[:, None]
        fx = torch.fft.fftfreq(size, dtype=torch.float64)[None, :]
        omega = 2 * math.pi * (fy ** 2 + fx ** 2).sqrt()  # the band's definition, written out again
        inside = (omega >= band * 0.1 * math.pi) & (omega < (band + 1) * 0.1 * math.pi)
        frac = power[..., inside].sum((-1, -2)) / power.sum((-1, -2, -3))
        assert float(frac.min()) >= 0.99, (band, frac)
        rms.append(noise.pow(2).mean((1, 2, 3)).sqrt())
    rms = torch.stack(rms)
    torch.testing.assert_close(rms, torch.full_like(rms, 0.1), rtol=1e-4, atol=0)


def test_band_noise_is_white_inside_the_band():
    """Drawn in the Fourier domain, it must have the spectrum of filtered white noise: flat within the band,
    including the columns the real FFT stores without their conjugate."""
    acc = torch.zeros(32, 32, dtype=torch.float64)
    for seed in range(40):
        gens = [P.image_generator(seed, "t", i) for i in range(16)]
        n = P.band_noise_like((16, 3, 32, 32), gens, band=2)
        acc += torch.fft.fft2(n.double()).abs().pow(2).mean((0, 1))
    inside = P.band_mask(32, 32, 2)
    v = acc[inside] / acc[inside].mean()
    assert float(v.min()) > 0.8 and float(v.max()) < 1.2
    col0 = inside.clone()
    col0[:, 1:] = False
    assert abs(float(acc[col0].mean() / acc[inside].mean()) - 1) < 0.1


def test_band_noise_is_deterministic_per_image_whatever_the_batch():
    x = torch.rand(4, 3, 32, 32)
    a = P.band_noise(x, torch.tensor([5, 6, 7, 8]), seed=0, band=4) - x
    b = P.band_noise(x[2:], torch.tensor([7, 8]), seed=0, band=4) - x[2:]
    torch.testing.assert_close(a[2:], b)
    c = P.band_noise(x, torch.tensor([5, 6, 7, 8]), seed=1, band=4) - x
    assert not torch.allclose(a, c)
    assert not torch.allclose(a[0], a[1])


def test_band_noise_rejects_a_band_that_does_not_exist():
    with pytest.raises(VitscopeError, match="does not exist"):
        P.band_noise(torch.rand(1, 3, 32, 32), torch.tensor([0]), 0, band=10)
    with pytest.raises(ConfigError, match="do not exist"):
        BandNoise.views({"bands": [3, 12]})


def _square_sign_reference(z: np.ndarray, band: int, width: float, eps: float) -> np.ndarray:
    """Park et al.'s public band noise written out with loops: +-eps sign noise per pixel, its spectrum shifted
    (zero frequency at the centre), every coefficient outside the square annulus of the band zeroed one by one,
    shifted back and inverted (real part); no renormalisation."""
    c, h, w = z.shape
    out = np.zeros((c, h, w))
    for ch in range(c):
        spec = np.fft.fftshift(np.fft.fft2(np.where(z[ch] >= 0, eps, -eps)))
        kept = np.zeros_like(spec)
        for i in range(h):
            for j in range(w):
                w_y, w_x = 2 * math.pi * abs(i - h // 2) / h, 2 * math.pi * abs(j - w // 2) / w
                if band * width <= max(w_y, w_x) < (band + 1) * width:
                    kept[i, j] = spec[i, j]
        out[ch] = np.fft.ifft2(np.fft.ifftshift(kept)).real
    return out


@pytest.mark.parametrize("size", [31, 32])
def test_square_sign_band_noise_is_the_source_definition(size):
    """definition=square_sign against an independent loop over the shifted spectrum, every band, odd and even
    sizes; its energy is not fixed (it grows with the band, as the expected rms says), the default's is."""
    x = torch.full((2, 3, size, size), 0.5)
    idx = torch.tensor([4, 9])
    eps, width = 0.1, 0.1 * math.pi
    rms = []
    for band in range(P.N_BANDS):
        got = (P.band_noise(x, idx, seed=2, band=band, definition="square_sign", eps=eps) - x).double()
        key = P.band_key(band, definition="square_sign", eps=eps)
        for b, i in enumerate(idx.tolist()):
            z = torch.randn(3, size, size, generator=P.image_generator(2, key, i)).double().numpy()
            want = _square_sign_reference(z, band, width, eps)
            np.testing.assert_allclose(got[b].numpy(), want, atol=2e-7, rtol=0)
        rms.append(float(got.pow(2).mean().sqrt()))
        assert math.isclose(rms[-1], P.square_band_rms(size, size, band), rel_tol=0.35)
    assert rms[-1] > 2.5 * rms[0] and max(rms) > 3.5 * rms[0]
    default = [float((P.band_noise(x, idx, seed=2, band=b) - x).pow(2).mean().sqrt()) for b in (0, 9)]
    assert default == pytest.approx([0.1, 0.1], rel=1e-4)


def test_band_definition_is_checked_at_config_time():
    with pytest.raises(ConfigError, match="band definition 'square' does not exist; choose circular_rms"):
        BandNoise.views({"band_definition": "square"})
    with pytest.raises(ConfigError, match="band definition 'square' does not exist"):
        P.band_noise(torch.rand(1, 3, 8, 8), torch.tensor([0]), 0, band=1, definition="square")
    assert BandNoise.views({"bands": [2]}) == ["clean", "band_noise:band=2,n_bands=10"]  # the default's key
    assert BandNoise.views({"bands": [2], "band_definition": "square_sign", "eps": 0.2}) == [
        "clean", "band_noise:band=2,n_bands=10,definition=square_sign,eps=0.2"]


@pytest.mark.slow
def test_band_definition_is_a_column_of_the_band_noise_table():
    from vitscope.models.load import load_model

    vm = load_model("zoo-mae")
    data = SyntheticShapes(n=16, seed=5)
    an = BandNoise(vm, bands=[9], layers=[7], band_definition="square_sign")
    run_passes(an, vm, {"data": data}, batch_size=16)
    df = an.finalize()
    assert set(df["band_definition"]) == {"square_sign"} and set(df["band"]) == {-1, 9}


# ---------------------------------------------------------------- corruptions
def _available(name):
    return name in P.NATIVE or P.package_available()


# Every corruption but three: saturate is not monotone by design (severities 1-2 desaturate, 3-5 saturate); the
# package's frost (severity 4 < 3) and glass blur at 32 px (ImageNet-C's parameters are for 224 px) are not
# monotone in pixel distance either.
CHECKED = ["gaussian_noise", "shot_noise", "impulse_noise", "speckle_noise", "gaussian_blur", "contrast",
           "jpeg_compression", "pixelate", "defocus_blur", "motion_blur", "fog", "brightness", "snow",
           "elastic_transform", "zoom_blur", "spatter"]


@pytest.mark.parametrize("name", CHECKED)
def test_corruption_is_deterministic_identity_at_0_and_grows_with_severity(name):
    if not _available(name):
        pytest.skip(f"{P.PACKAGE} not installed")
    ds = SyntheticShapes(n=16, seed=0)
    x = torch.stack([torch.from_numpy(ds.sample(i, 32).image).permute(2, 0, 1) for i in range(16)])
    idx = torch.arange(16)
    assert torch.equal(P.corrupt_batch(x, idx, 0, name, 0), x)
    a, b = P.corrupt_batch(x, idx, 0, name, 3), P.corrupt_batch(x, idx, 0, name, 3)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    dist = [float((P.corrupt_batch(x, idx, 0, name, s) - x).pow(2).mean()) for s in P.SEVERITIES]
    assert dist[0] > 0
    assert all(b >= a * 0.98 for a, b in zip(dist[:-1], dist[1:], strict=True)), dist  # monotone (2% slack)
    assert dist[-1] > dist[0]


@pytest.mark.parametrize("name", ["gaussian_blur", "brightness", "contrast", "jpeg_compression", "pixelate"])
def test_native_deterministic_corruptions_match_the_package(name):
    pytest.importorskip("imagecorruptions")
    from imagecorruptions import corrupt

    x = (torch.rand(2, 3, 40, 36) * 255).round() / 255
    for s in (1, 3, 5):
        ours = P.corrupt_batch(x, torch.arange(2), 0, name, s, backend="native")
        for i in range(2):
            u8 = (x[i] * 255).round().byte().permute(1, 2, 0).numpy()
            ref = torch.from_numpy(np.asarray(corrupt(u8, severity=s, corruption_name=name), np.float32) / 255)
            diff = (ours[i].permute(1, 2, 0) - ref).abs()
            assert float(diff.max()) <= 1.5 / 255, (name, s, float(diff.max()))


@pytest.mark.parametrize("name", ["gaussian_noise", "shot_noise", "impulse_noise"])
def test_native_noise_matches_the_package_in_distribution(name):
    pytest.importorskip("imagecorruptions")
    from imagecorruptions import corrupt

    x = torch.full((1, 3, 64, 64), 0.5)
    x[..., :32] = 0.2
    ours = P.corrupt_batch(x.repeat(8, 1, 1, 1), torch.arange(8), 0, name, 3, backend="native") - x
    np.random.seed(0)
    u8 = (x[0] * 255).round().byte().permute(1, 2, 0).numpy()
    ref = torch.stack([torch.from_numpy(np.asarray(corrupt(u8, 3, name), np.float32) / 255).permute(2, 0, 1)
                       for _ in range(8)]) - x
    for region in (slice(0, 32), slice(32, 64)):
        a, b = ours[..., region], ref[..., region]
        assert abs(float(a.abs().mean() - b.abs().mean())) < 0.01
        assert abs(float(a.std() - b.std())) < 0.01


def test_unknown_corruption_or_severity_fails_at_config_time_with_one_sentence():
    with pytest.raises(ConfigError, match="unknown corruption 'gausian_noise'; did you mean gaussian_noise"):
        Corruptions.views({"corruptions": ["gausian_noise"]})
    with pytest.raises(ConfigError, match="severity 6 does not exist"):
        Corruptions.views({"corruptions": ["contrast"], "severities": [1, 6]})
    with pytest.raises(ConfigError, match="severity 2.5 does not exist"):
        Corruptions.views({"corruptions": ["contrast"], "severities": [2.5]})
    views = Corruptions.views({"corruptions": ["noise"], "severities": [1, 5]})
    assert views[0] == "clean" and len(views) == 1 + 3 * 2


# ---------------------------------------------------------------- shape bias
def _info(depth=1, cls=True):
    return ModelInfo("m", depth, 1, 8, (1, 1), 32, 1 if cls else 0, cls)


def _feed_vectors(an, vectors, labels, texture, dataset, bs=64):
    """Feed per-image vectors to an analysis as the CLS token of a one-block model."""
    for s in range(0, len(vectors), bs):
        v = vectors[s:s + bs].float()
        tokens = torch.stack([v, torch.zeros_like(v)], dim=1)  # CLS + one patch token
        b = Batch(images=torch.zeros(len(v), 3, 1, 1), index=torch.arange(s, s + len(v)), labels=labels[s:s + bs])
        if texture is not None:
            b.extra["texture_labels"] = texture[s:s + bs]
        b.dataset, b.view = dataset, "clean"
        an.update({"block0.out": tokens}, b)


def _colour_histograms(ds, n, levels=6):
    """The object's colour histogram only (no geometry): what a purely texture-driven readout sees."""
    xs, ys, ts = [], [], []
    for i in range(n):
        s = ds.sample(i, 32)
        q = np.minimum((s.image[s.mask] * levels).astype(int), levels - 1)
        h = np.bincount(q[:, 0] * levels ** 2 + q[:, 1] * levels + q[:, 2], minlength=levels ** 3)
        xs.append(h / max(len(q), 1))
        ys.append(s.label)
        ts.append(s.extra.get("texture_label", -1))
    return torch.tensor(np.array(xs)), torch.tensor(ys), torch.tensor(ts)


def test_shape_bias_of_a_colour_histogram_readout_is_zero_and_of_a_shape_oracle_is_one():
    train = SyntheticShapes(n=300, seed=1, variant="texture-bound")
    cue = SyntheticShapes(n=120, seed=2, variant="cue-conflict")
    xtr, ytr, _ = _colour_histograms(train, 300)
    xcue, ycue, tcue = _colour_histograms(cue, 120)
    assert (ycue != tcue).all()
    for feats_train, feats_cue, want in [(xtr, xcue, 0.0),
                                         (torch.eye(12)[ytr], torch.eye(12)[ycue], 1.0)]:  # oracle: the shape label
        an = ShapeBias(_info(), test_every=5)
        an.datasets = {"data": "cue", "train": "train"}
        an.configure({"data": list(range(12)), "train": list(range(12))})
        _feed_vectors(an, feats_train, ytr, None, "train")
        _feed_vectors(an, feats_cue, ycue, tcue, "cue")
        df = an.finalize()
        v = df.set_index("metric")["value"]
        assert abs(v["shape_bias"] - want) <= 0.05, v["shape_bias"]
        assert v["n_shape"] + v["n_texture"] + v["n_other"] == v["n_images"] == 120
        bias = df[df.metric == "shape_bias"].iloc[0]  # its Wilson interval over the shape + texture decisions
        lo, hi, se = S.binomial_interval(bias["value"], int(v["n_shape"] + v["n_texture"]))
        assert (bias["value_lo"], bias["value_hi"], bias["stderr"]) == (lo, hi, se)
        assert lo <= bias["value"] <= hi
        assert (df["readout"] == "probe").all() and (df["layer"] == 0).all()
        assert set(df["match_denominator"]) == {"all"}  # the protocol setting, named in the table


def test_a_probe_at_chance_gives_a_reason_not_a_shape_bias():
    """Features that carry no class (noise) give a probe within noise of chance on the held-out clean images: no
    shape bias, a reason; features that carry the shape give a number and no reason."""
    gen = torch.Generator().manual_seed(0)
    ytr, ycue = torch.arange(300) % 12, torch.arange(120) % 12
    tcue = (ycue + 1) % 12
    for xtr, xcue, informative in [(torch.randn(300, 12, generator=gen), torch.randn(120, 12, generator=gen), False),
                                   (torch.eye(12)[ytr], torch.eye(12)[ycue], True)]:
        an = ShapeBias(_info(), test_every=5)
        an.datasets = {"data": "cue", "train": "train"}
        an.configure({"data": list(range(12)), "train": list(range(12))})
        _feed_vectors(an, xtr, ytr, None, "train")
        _feed_vectors(an, xcue, ycue, tcue, "cue")
        df = an.finalize()
        bias = df[df.metric == "shape_bias"].iloc[0]
        acc = df[df.metric == "clean_accuracy"].iloc[0]
        if informative:
            assert np.isfinite(bias["value"]) and bias["reason"] is None and acc["value_lo"] > acc["chance"]
        else:
            assert acc["value_lo"] <= acc["chance"] and np.isnan(bias["value"])
            assert "within noise of chance" in bias["reason"]
            assert ShapeBias.key_numbers(df)["reason"].iloc[0] == bias["reason"]


def test_shape_bias_counts_add_up_and_leave_out_agreeing_cues():
    d = torch.tensor([0, 1, 2, 3, 1, 0])
    s = torch.tensor([0, 0, 2, 3, 3, 1])
    t = torch.tensor([1, 1, 2, 1, 1, 0])
    c = R.shape_bias_counts(d, s, t)
    assert c["n_excluded"] == 1  # image 2: shape == texture
    assert (c["n_shape"], c["n_texture"], c["n_other"]) == (2, 3, 0)
    assert c["shape_bias"] == pytest.approx(2 / 5)


def test_shape_and_texture_match_divide_by_every_image_as_model_vs_human():
    """model-vs-human's ShapeBias.analysis written out with pandas: rows whose shape and texture agree are
    dropped from the numerators (df2) but not from the denominator (len(df)); 'kept' divides by df2."""
    import pandas as pd

    g = torch.Generator().manual_seed(4)
    n = 200
    shape, texture = torch.randint(0, 5, (n,), generator=g), torch.randint(0, 5, (n,), generator=g)
    dec = torch.where(torch.rand(n, generator=g) < 0.5, shape, torch.randint(0, 5, (n,), generator=g))
    df = pd.DataFrame({"object_response": dec.numpy(), "correct_shape": shape.numpy(),
                       "correct_texture": texture.numpy()})
    df2 = df.loc[df.correct_shape != df.correct_texture]
    assert 0 < len(df2) < len(df)
    want_shape = len(df2.loc[df2.object_response == df2.correct_shape]) / len(df)
    want_texture = len(df2.loc[df2.object_response == df2.correct_texture]) / len(df)
    c = R.shape_bias_counts(dec, shape, texture)  # default: model-vs-human's denominator
    assert c["shape_match"] == pytest.approx(want_shape) and c["texture_match"] == pytest.approx(want_texture)
    assert c["shape_bias"] == pytest.approx(want_shape / (want_shape + want_texture))
    kept = R.shape_bias_counts(dec, shape, texture, "kept")
    assert kept["shape_match"] == pytest.approx(want_shape * len(df) / len(df2))
    assert kept["shape_bias"] == c["shape_bias"]
    with pytest.raises(ConfigError, match="match_denominator 'images' does not exist; choose all"):
        ShapeBias.views({"match_denominator": "images"})  # the planner calls it before any model loads
    with pytest.raises(ConfigError, match="match_denominator 'images' does not exist"):
        R.shape_bias_counts(dec, shape, texture, "images")


# ---------------------------------------------------------------- the 16-class mapping
# The WordNet ids of each category, as published beside the index lists (bethgelab/model-vs-human,
# modelvshuman/helper/human_categories.py, HumanCategories.<category>): mapped to ImageNet-1k indices through
# timm's own ImageNet class list, they must give exactly the index lists vitscope writes out.
WNIDS = {
    "knife": "n03041632", "keyboard": "n03085013 n04505470", "elephant": "n02504013 n02504458",
    "bicycle": "n02835271 n03792782", "airplane": "n02690373 n03955296 n13861050 n13941806",
    "clock": "n02708093 n03196217 n04548280", "oven": "n03259401 n04111414 n04111531",
    "chair": "n02791124 n03376595 n04099969 n00605023 n04429376",
    "bear": "n02132136 n02133161 n02134084 n02134418",
    "boat": "n02951358 n03344393 n03662601 n04273569 n04612373 n04612504",
    "cat": "n02122878 n02123045 n02123159 n02126465 n02123394 n02123597 n02124075 n02125311",
    "bottle": "n02823428 n03937543 n03983396 n04557648 n04560804 n04579145 n04591713",
    "truck": "n03345487 n03417042 n03770679 n03796401 n00319176 n01016201 n03930630 n03930777 n05061003 "
             "n06547832 n10432053 n03977966 n04461696 n04467665",
    "car": "n02814533 n03100240 n03100346 n13419325 n04285008",
    "bird": "n01321123 n01514859 n01792640 n07646067 n01530575 n01531178 n01532829 n01534433 n01537544 "
            "n01558993 n01562265 n01560419 n01582220 n10281276 n01592084 n01601694 n01614925 n01616318 "
            "n01622779 n01795545 n01796340 n01797886 n01798484 n01817953 n01818515 n01819313 n01820546 "
            "n01824575 n01828970 n01829413 n01833805 n01843065 n01843383 n01855032 n01855672 n07646821 "
            "n01860187 n02002556 n02002724 n02006656 n02007558 n02009229 n02009912 n02011460 n02013706 "
            "n02017213 n02018207 n02018795 n02025239 n02027492 n02028035 n02033041 n02037110 n02051845 n02056570",
    "dog": "n02085782 n02085936 n02086079 n02086240 n02086646 n02086910 n02087046 n02087394 n02088094 n02088238 "
           "n02088364 n02088466 n02088632 n02089078 n02089867 n02089973 n02090379 n02090622 n02090721 n02091032 "
           "n02091134 n02091244 n02091467 n02091635 n02091831 n02092002 n02092339 n02093256 n02093428 n02093647 "
           "n02093754 n02093859 n02093991 n02094114 n02094258 n02094433 n02095314 n02095570 n02095889 n02096051 "
           "n02096294 n02096437 n02096585 n02097047 n02097130 n02097209 n02097298 n02097474 n02097658 n02098105 "
           "n02098286 n02099267 n02099429 n02099601 n02099712 n02099849 n02100236 n02100583 n02100735 n02100877 "
           "n02101006 n02101388 n02101556 n02102040 n02102177 n02102318 n02102480 n02102973 n02104029 n02104365 "
           "n02105056 n02105162 n02105251 n02105505 n02105641 n02105855 n02106030 n02106166 n02106382 n02106550 "
           "n02106662 n02107142 n02107312 n02107574 n02107683 n02107908 n02108000 n02108422 n02108551 n02108915 "
           "n02109047 n02109525 n02109961 n02110063 n02110185 n02110627 n02110806 n02110958 n02111129 n02111277 "
           "n08825211 n02111500 n02112018 n02112350 n02112706 n02113023 n02113624 n02113712 n02113799 n02113978",
}


def test_16_class_index_lists_match_the_published_wordnet_ids():
    from timm.data import ImageNetInfo

    info = ImageNetInfo()
    index = {info.index_to_label_name(i): i for i in range(1000)}
    assert list(R.CATEGORIES_16) == sorted(WNIDS)
    for category, wnids in WNIDS.items():
        want = sorted(index[w] for w in wnids.split() if w in index)
        assert list(R.IMAGENET_16_INDICES[category]) == want, category
    every = [i for c in R.CATEGORIES_16 for i in R.IMAGENET_16_INDICES[c]]
    assert len(every) == len(set(every)) == 207  # disjoint; 207 of the 1000 classes map to a category


@pytest.mark.parametrize("category", R.CATEGORIES_16)
def test_an_imagenet_head_favouring_a_category_decides_it(category):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 1000, generator=g)
    logits[:, list(R.IMAGENET_16_INDICES[category])] += 6.0
    scores = R.imagenet_to_16(logits)
    assert (scores.argmax(1) == R.CATEGORIES_16.index(category)).all()
    # mean, not sum: one strongly favoured class of a small category beats many weak ones of 'dog'
    logits = torch.zeros(1, 1000)
    logits[0, list(R.IMAGENET_16_INDICES["dog"])] = 1.0
    logits[0, 404] = 3.0
    assert R.CATEGORIES_16[int(R.imagenet_to_16(logits).argmax())] == "airplane"


# ---------------------------------------------------------------- readouts on real models
class _Cifar:
    """CIFAR-10-shaped stand-in (generated scenes relabelled with CIFAR-10's 10 classes)."""

    name = "cifar10-test"
    classes = list(R.CIFAR10_CLASSES)

    def __init__(self, n):
        self.ds = SyntheticShapes(n=n, seed=4)

    def __len__(self):
        return len(self.ds)

    def batches(self, batch_size, pre, start=0, indices=None):
        for b in self.ds.batches(batch_size, pre, start, indices):
            b.labels = b.labels % 10
            yield b


def test_readout_is_the_head_when_it_covers_the_data_else_the_probe():
    from vitscope.models.load import load_model

    sup, dino = load_model("zoo-sup"), load_model("zoo-dino")
    assert head_label_space(sup) == "cifar10" and head_label_space(dino) is None
    data = _Cifar(40)
    tables = {}
    for vm in (sup, dino):
        an = Corruptions(vm, corruptions=["contrast"], severities=[5], layers=[-1], test_every=2)
        run_passes(an, vm, {"data": data}, batch_size=20)
        tables[vm.name] = an.finalize()
    assert set(tables["zoo-sup"]["readout"]) == {"head", "probe"}
    assert set(tables["zoo-dino"]["readout"]) == {"probe"}
    head = tables["zoo-sup"][tables["zoo-sup"].readout == "head"]
    assert head["layer"].isna().all() and (head[head.metric == "accuracy"]["n_images"] == 40).all()
    probe = tables["zoo-dino"][tables["zoo-dino"].metric == "accuracy"]
    labels = torch.cat([b.labels for b in data.batches(40, sup.preprocessing)]).tolist()
    sizes = [labels.count(c) for c in set(labels)]
    n_test = sum((k + 1) // 2 for k in sizes if k > 1)  # per class every 2nd image, from the first; one alone trains
    assert (probe["layer"] == 7).all() and (probe["n_images"] == n_test).all()  # the test split only
    assert (probe["n_test"] == n_test).all() and (probe["n_train"] == 40 - n_test).all()
    assert probe["probe_weight_decay"].notna().all() and (probe["probe_iterations"] > 0).all()
    an = Corruptions(sup, corruptions=["contrast"], severities=[5], readout="head")
    an.datasets = {"data": "synthetic-shapes"}
    with pytest.raises(ConfigError, match="readout 'head' needs a classifier"):
        an.configure({"data": list(SyntheticShapes().classes)})


def test_no_head_and_no_clean_data_fails_at_config_time():
    an = ShapeBias(_info())
    an.datasets = {"data": "cue-conflict", "train": None}
    with pytest.raises(ConfigError, match="no classifier head .* no clean images for a linear probe"):
        an.configure({"data": list(R.CATEGORIES_16)})
    an = ShapeBias(_info())
    an.datasets = {"data": "cue-conflict", "train": "synthetic-shapes"}
    with pytest.raises(ConfigError, match="other classes"):
        an.configure({"data": list(R.CATEGORIES_16), "train": list(SyntheticShapes().classes)})
    an = Corruptions(_info(), corruptions=["contrast"])
    an.datasets = {"data": "corrupted:CIFAR-10-C"}
    with pytest.raises(ConfigError, match="holds only corrupted images"):
        an.configure({"data": list(R.CIFAR10_CLASSES)})


# ---------------------------------------------------------------- accumulators
def test_band_noise_shards_merge_to_the_single_pass_and_state_round_trips():
    from vitscope.models.load import load_model

    vm = load_model("zoo-mae")
    data = SyntheticShapes(n=40, seed=5)
    whole = BandNoise(vm, bands=[0, 9], layers=[1, 7])
    run_passes(whole, vm, {"data": data}, batch_size=16)

    class Part:
        def __init__(self, ids):
            self.ids, self.name, self.classes = ids, data.name, data.classes

        def __len__(self):
            return len(self.ids)

        def batches(self, bs, pre, start=0, indices=None):
            return data.batches(bs, pre, indices=self.ids)

    a, b = BandNoise(vm, bands=[0, 9], layers=[1, 7]), BandNoise(vm, bands=[0, 9], layers=[1, 7])
    run_passes(a, vm, {"data": Part(list(range(0, 24)))}, batch_size=16)
    run_passes(b, vm, {"data": Part(list(range(24, 40)))}, batch_size=16)
    c = BandNoise(vm, bands=[0, 9], layers=[1, 7])
    c.load_state_dict(a.state_dict())
    c.merge(b)
    x, y = whole.finalize(), c.finalize()
    key = ["readout", "layer", "band", "metric"]
    x, y = x.sort_values(key).reset_index(drop=True), y.sort_values(key).reset_index(drop=True)
    np.testing.assert_allclose(x["value"], y["value"], atol=1e-9)
    assert set(x["band"]) == {-1, 0, 9} and set(x["metric"]) == {"accuracy", "drop"}


def test_figures_of_every_robustness_analysis_draw_from_the_tables():
    from vitscope.report.figures import FIGURES

    rng = np.random.default_rng(0)
    rows_sb, rows_bn, rows_c = [], [], []
    for m, head in [("a", True), ("b", False)]:
        for layer in range(4):
            rows_sb.append({"model": m, "metric": "shape_bias", "layer": layer, "readout": "probe",
                            "value": rng.uniform()})
            for band in range(-1, 10):
                rows_bn.append({"model": m, "metric": "accuracy", "layer": layer, "readout": "probe", "band": band,
                                "band_low": band / 10, "value": rng.uniform()})
                if band >= 0:
                    rows_bn.append({"model": m, "metric": "drop", "layer": layer, "readout": "probe", "band": band,
                                    "band_low": band / 10, "value": rng.uniform(-0.1, 0.5)})
            for c, f in [("clean", "clean"), ("contrast", "digital"), ("gaussian_noise", "noise")]:
                for s in ([0] if c == "clean" else [1, 3, 5]):
                    rows_c.append({"model": m, "metric": "accuracy", "layer": layer, "readout": "probe",
                                   "corruption": c, "severity": s, "family": f, "value": rng.uniform()})
            rows_c.append({"model": m, "metric": "mca", "layer": layer, "readout": "probe", "corruption": None,
                           "severity": None, "family": None, "value": rng.uniform()})
        if head:
            rows_sb.append({"model": m, "metric": "shape_bias", "layer": None, "readout": "head", "value": 0.3})
    import pandas as pd

    for name, rows, n in [("shape_bias", rows_sb, 1), ("band_noise", rows_bn, 2), ("corruptions", rows_c, 1)]:
        figs = FIGURES[name](pd.DataFrame(rows))
        assert len(figs) == n, name
    fig = FIGURES["shape_bias"](pd.DataFrame(rows_sb))[0][1]
    ax = fig.axes[0]
    xs = sorted(float(line.get_xdata()[0]) for line in ax.lines if len(line.get_xdata()) == 1)
    assert 0.3 in xs  # the head's shape bias of model a


def test_cue_conflict_folder_parses_the_published_layout_and_rejects_other_names(tmp_path):
    from PIL import Image

    from vitscope.data.formats.robustness import CueConflictFolder

    img = Image.new("RGB", (8, 8))
    for shape, tex in [("cat", "dog"), ("dog", "cat"), ("dog", "dog")]:
        (tmp_path / shape).mkdir(exist_ok=True)
        img.save(tmp_path / shape / f"{shape}1-{tex}2.png")
    ds = CueConflictFolder(tmp_path)
    assert ds.classes == ["cat", "dog"] and ds.labels == [0, 1, 1] and ds.texture_labels == [1, 0, 1]
    from vitscope.models.registry import Preprocessing

    b = next(ds.batches(3, Preprocessing(input_size=8, crop_pct=1.0)))
    assert b.extra["texture_labels"].tolist() == [1, 0, 1]
    img.save(tmp_path / "cat" / "cat_3.png")
    with pytest.raises(InputError, match=r"1 files .* not named <shape><i>-<texture><j>.*cat/cat_3.png"):
        CueConflictFolder(tmp_path)


def test_precorrupted_cifar10c_folder_is_scored_per_corruption_and_severity_by_the_head(tmp_path):
    from vitscope.data.formats.robustness import CorruptedFolder
    from vitscope.models.load import load_model

    rng = np.random.default_rng(0)
    np.save(tmp_path / "contrast.npy", rng.integers(0, 255, (5 * 4, 32, 32, 3), dtype=np.uint8))
    np.save(tmp_path / "labels.npy", np.arange(20) % 10)
    ds = CorruptedFolder(tmp_path, severities=[2, 5])
    assert len(ds) == 8 and ds.classes == list(R.CIFAR10_CLASSES)
    assert [(c, s) for c, s, _, _ in ds.entries] == [("contrast", 2)] * 4 + [("contrast", 5)] * 4
    vm = load_model("zoo-sup")
    an = Corruptions(vm, corruptions=["contrast"], severities=[2, 5])
    run_passes(an, vm, {"data": ds}, batch_size=3, views=["clean"])
    df = an.finalize()
    acc = df[df.metric == "accuracy"]
    assert set(df["readout"]) == {"head"}
    assert sorted(zip(acc["severity"], acc["n_images"], strict=True)) == [(2, 4), (5, 4)]
    dino = load_model("zoo-dino")
    an = Corruptions(dino, corruptions=["contrast"], severities=[2, 5])
    with pytest.raises(ConfigError, match="no classifier head .* holds only corrupted images"):
        run_passes(an, dino, {"data": ds}, batch_size=3, views=["clean"])
    ds.name = "my-c"  # a name that does not say what it holds: caught at its first batch
    an = Corruptions(dino, corruptions=["contrast"], severities=[2, 5])
    with pytest.raises(ConfigError, match="holds pre-corrupted images, which only a classifier head"):
        run_passes(an, dino, {"data": ds}, batch_size=3, views=["clean"])
    with pytest.raises(InputError, match="not ImageNet-C / CIFAR-10-C corruptions"):
        CorruptedFolder(tmp_path, corruptions=["fogg"])
    with pytest.raises(InputError, match="severities are 1..5"):
        CorruptedFolder(tmp_path, severities=[0])


def test_default_study_plans_the_robustness_lenses_on_their_datasets():
    from vitscope.study import load_config
    from vitscope.study.plan import make_plan

    plan = {ap.name: ap for ap in make_plan(load_config()).analyses}
    assert plan["shape_bias"].slots == {"data": "cue-conflict", "train": "silhouettes"}
    bands = load_config().analyses["band_noise"]["bands"]
    assert plan["band_noise"].slots == {"data": "cifar10-128"} and len(plan["band_noise"].views) == 1 + len(bands)
    assert [v for v in plan["band_noise"].views if v != "clean"] == [f"band_noise:band={b},n_bands=10" for b in bands]
    corr = load_config().analyses["corruptions"]
    assert len(plan["corruptions"].views) == 1 + len(corr["corruptions"]) * len(corr["severities"])
    assert plan["semantics"].slots["data"] == "cifar10"  # the other analyses keep their datasets


def _geirhos_folder(root, n=3):
    from PIL import Image

    rng = np.random.default_rng(0)
    cats = ["bird", "cat", "dog", "truck"]
    for shape in cats:
        (root / shape).mkdir(parents=True)
        for i in range(n):
            tex = cats[(cats.index(shape) + 1 + i) % len(cats)]
            img = Image.fromarray(rng.integers(0, 255, (48, 48, 3), dtype=np.uint8))
            img.save(root / shape / f"{shape}{i}-{tex}{i}.png")


STUDY = """
models:
  - {{name: vit_small_patch16_224, label: {label}, pretrained: false,
      kwargs: {{img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3, num_classes: {nc}}}}}
datasets:
  stimuli: {{name: cue-conflict, root: {root}}}
  shapes: {{name: synthetic-shapes, n_images: 24}}
analyses:
  shape_bias: {{dataset: stimuli, train_dataset: shapes}}
batch_size: 8
progress: false
"""


def test_geirhos_folder_through_a_study_uses_an_imagenet_head_and_refuses_a_headless_model(tmp_path):
    import pandas as pd

    from vitscope.study import load_config, run_study

    _geirhos_folder(tmp_path / "stimuli")
    p = tmp_path / "s.yaml"
    p.write_text(STUDY.format(label="in1k", nc=1000, root=tmp_path / "stimuli"))
    out = run_study(load_config(p, [f"output_dir={tmp_path / 'run'}"]))
    df = pd.read_parquet(out / "results" / "shape_bias.parquet")
    assert set(df["readout"]) == {"head"}  # the shapes' 12 classes are not the stimuli's: no probe
    v = df.set_index("metric")["value"]
    assert v["n_images"] == 12 and v["n_shape"] + v["n_texture"] + v["n_other"] == 12
    p.write_text(STUDY.format(label="headless", nc=0, root=tmp_path / "stimuli"))
    with pytest.raises(ConfigError, match="no classifier head covering the classes of stimuli"):
        run_study(load_config(p, [f"output_dir={tmp_path / 'run2'}"]))


def _hsv_value_plus(img: np.ndarray, c: float) -> np.ndarray:
    """make_cifar_c.py's brightness, per pixel through colorsys: HSV value + c, clipped."""
    import colorsys

    out = np.empty_like(img)
    for idx in np.ndindex(img.shape[:2]):
        h, s, v = colorsys.rgb_to_hsv(*img[idx])
        out[idx] = colorsys.hsv_to_rgb(h, s, min(v + c, 1.0))
    return out


@pytest.mark.parametrize("name", ["contrast", "gaussian_blur", "brightness"])
def test_cifar_table_is_cifar10c_as_make_cifar_c_writes_it(name):
    """CIFAR-10-C's constants (hendrycks/robustness, ImageNet-C/create_c/make_cifar_c.py), each corruption
    re-implemented here from that script's formulas with numpy / scipy."""
    from scipy.ndimage import gaussian_filter

    constants = {"contrast": [.75, .5, .4, .3, 0.15], "gaussian_blur": [.4, .6, 0.7, .8, 1],
                 "brightness": [.05, .1, .15, .2, .3]}[name]
    rng = np.random.default_rng(0)
    x = rng.random((2, 32, 32, 3))
    for s in (1, 3, 5):
        ours = P.corrupt_batch(torch.from_numpy(x).permute(0, 3, 1, 2).float(), torch.arange(2), 0, name, s,
                               table="cifar").permute(0, 2, 3, 1).double().numpy()
        c = constants[s - 1]
        for i in range(2):
            if name == "contrast":
                ref = (x[i] - x[i].mean(axis=(0, 1), keepdims=True)) * c + x[i].mean(axis=(0, 1), keepdims=True)
            elif name == "gaussian_blur":  # skimage.filters.gaussian: scipy's filter, 'nearest', truncate 4
                ref = np.stack([gaussian_filter(x[i][..., k], c, mode="nearest", truncate=4.0) for k in range(3)], -1)
            else:
                ref = _hsv_value_plus(x[i], c)
            np.testing.assert_allclose(ours[i], np.clip(ref, 0, 1), atol=2e-6)


def test_cifar_table_noise_has_cifar10c_strength_and_is_milder_than_imagenet_c():
    x = torch.full((64, 3, 32, 32), 0.5)
    ids = torch.arange(64)
    for s, c in zip(P.SEVERITIES, [0.04, 0.06, .08, .09, .10], strict=True):
        noise = P.corrupt_batch(x, ids, 0, "gaussian_noise", s, table="cifar") - x
        assert abs(float(noise.std()) - c) < 0.05 * c  # make_cifar_c.py: normal noise of std c (none clipped at 0.5)
    for name in P.NATIVE:
        for s in (1, 5):
            d = {t: float((P.corrupt_batch(torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(1)),
                                           torch.arange(4), 0, name, s, table=t) -
                           torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))).abs().mean())
                 for t in ("cifar", "imagenet")}
            assert d["cifar"] < d["imagenet"], (name, s, d)


def test_cifar_table_without_its_constants_is_one_sentence_at_config_time():
    from vitscope.analyses.robustness import Corruptions

    assert Corruptions.views({"corruptions": ["contrast"], "severities": [3], "table": "cifar"}) == [
        "clean", "corruption:name=contrast,severity=3,table=cifar"]
    with pytest.raises(ConfigError, match="the cifar table holds the native corruptions only.*fog"):
        Corruptions.views({"corruptions": ["fog"], "severities": [3], "table": "cifar"})
    with pytest.raises(ConfigError, match="corruption table 'cifra' does not exist"):
        Corruptions.views({"corruptions": ["contrast"], "severities": [3], "table": "cifra"})


# ---------------------------------------------------------------- views on the batch's device
# The draws come from per-image CPU generators and everything after them runs where the batch is (a GPU in a
# study on one). No GPU here: the CPU path is checked against a per-image reference that draws and computes
# on the host (the implementation before views moved to the device), bit for bit, and the device path against
# it on a CUDA device where one exists (up to float rounding).

def _host_reference(name: str, x: torch.Tensor, index: torch.Tensor, seed: int, s: int) -> torch.Tensor:
    """The native noise corruptions one image at a time, every draw and every operation on the CPU."""
    c = P.TABLES["imagenet"][name][s - 1]
    out = []
    for xi, i in zip(x.cpu(), index.tolist(), strict=True):
        g = P.image_generator(seed, P.corruption_key(name, s), int(i))
        if name == "gaussian_noise":
            y = xi + c * torch.randn(xi.shape, generator=g)
        elif name == "speckle_noise":
            y = xi + xi * c * torch.randn(xi.shape, generator=g)
        elif name == "shot_noise":
            y = torch.poisson(xi * c, generator=g) / c
        else:  # impulse_noise
            u = torch.rand((2, *xi.shape), generator=g)
            y = xi.clone()
            flip = u[0] < c
            y[flip] = (u[1][flip] < 0.5).float()
        out.append(y.clamp(0, 1))
    return torch.stack(out)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["gaussian_noise", "speckle_noise", "shot_noise", "impulse_noise"])
def test_native_noise_on_the_batch_device_is_the_per_image_host_noise(name, device):
    x = torch.rand(5, 3, 24, 20, generator=torch.Generator().manual_seed(3))
    index = torch.tensor([7, 2, 40, 3, 11])
    ref = _host_reference(name, x, index, 5, 3)
    got = P.corrupt_batch(x.to(device), index, 5, name, 3, backend="native")
    assert got.device.type == device and got.dtype == x.dtype
    tol = 0 if device == "cpu" else 1e-6
    torch.testing.assert_close(got.cpu(), ref, rtol=0, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", ["band_noise:band=2", "band_noise:band=7,definition=square_sign",
                                  "corruption:name=gaussian_blur,severity=3", "corruption:name=brightness,severity=2",
                                  "corruption:name=contrast,severity=4", "corruption:name=pixelate,severity=3"])
def test_a_view_stays_on_the_batch_device_and_an_image_alone_gets_its_row_of_the_batch(spec, device):
    from vitscope.data.views import VIEW_KINDS, parse_view

    kind, kwargs = parse_view(spec)
    fn = VIEW_KINDS[kind]
    x = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    index = torch.tensor([9, 0, 5, 2])
    on_cpu = fn(x, index, 1, **kwargs)
    got = fn(x.to(device), index, 1, **kwargs)
    assert got.device.type == device
    torch.testing.assert_close(got.cpu(), on_cpu, rtol=0, atol=0 if device == "cpu" else 1e-5)
    for j in range(4):  # the same pixels whatever else is in the batch
        alone = fn(x[j:j + 1], index[j:j + 1], 1, **kwargs)
        torch.testing.assert_close(alone[0], on_cpu[j], rtol=0, atol=1e-6)


def test_band_noise_of_a_float64_batch_is_the_float32_noise_up_to_rounding():
    """The noise is made in the batch's dtype's world (as on another device): the same pixels up to rounding."""
    x = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    index = torch.arange(3)
    a = P.band_noise(x, index, 0, band=3)
    b = P.band_noise(x.double(), index, 0, band=3)
    assert b.dtype == torch.float64
    torch.testing.assert_close(b.float(), a, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- tallies the head's decisions leave on the device
def _tally_reference(d, y, c):
    """Accuracy, count and majority-class rate written out image by image (the slow way)."""
    d, y = d.tolist(), y.tolist()
    n = len(y)
    if not n:
        return float("nan"), 0, float("nan")
    per = [sum(1 for v in y if v == k) for k in range(c)]
    return sum(a == b for a, b in zip(d, y, strict=True)) / n, n, max(per) / n


@pytest.mark.parametrize("seed", range(5))
def test_accuracy_tallies_of_batches_add_up_to_the_accuracy_and_chance_of_all_images(seed):
    g = torch.Generator().manual_seed(seed)
    c, n = 7, int(torch.randint(0, 60, (1,), generator=g))
    d, y = torch.randint(0, c, (n,), generator=g), torch.randint(0, c, (n,), generator=g)
    keep = torch.rand(n, generator=g) > 0.3
    cuts = sorted(torch.randint(0, n + 1, (3,), generator=g).tolist())
    parts = list(zip(d.tensor_split(cuts), y.tensor_split(cuts), keep.tensor_split(cuts), strict=True))
    total = sum(R.accuracy_tally(a, b, c) for a, b, _ in parts)
    acc, m, chance = R.accuracy_of_tally(total)
    want = _tally_reference(d, y, c)
    assert m == want[1] and (acc, chance) == pytest.approx(want[::2], nan_ok=True)
    if n:  # the numbers the per-image code gave, bit for bit
        assert acc == R.accuracy(d, y) and chance == majority_rate(y, y)
    kept = R.accuracy_of_tally(sum(R.accuracy_tally(a, b, c, k) for a, b, k in parts))
    want = _tally_reference(d[keep], y[keep], c)
    assert kept[1] == want[1] and (kept[0], kept[2]) == pytest.approx(want[::2], nan_ok=True)


def test_an_image_labelled_outside_the_classes_counts_but_is_never_correct_nor_in_a_class():
    """No label indexes outside the tally (on a GPU a device-side assert): such an image is one more image."""
    g = torch.Generator().manual_seed(3)
    c, n = 5, 80
    d, y = torch.randint(0, c, (n,), generator=g), torch.randint(-2, c + 2, (n,), generator=g)
    acc, m, chance = R.accuracy_of_tally(R.accuracy_tally(d, y, c))
    assert (acc, m, chance) == pytest.approx(_tally_reference(d, y, c))


@pytest.mark.parametrize("denominator", ["all", "kept"])
def test_shape_bias_tallies_of_batches_add_up_to_the_counts_of_all_images(denominator):
    g = torch.Generator().manual_seed(1)
    n = 50
    d, s, t = (torch.randint(0, 4, (n,), generator=g) for _ in range(3))
    tally = R.shape_bias_tally(d[:17], s[:17], t[:17]) + R.shape_bias_tally(d[17:], s[17:], t[17:])
    got = R.shape_bias_of_tally(tally, denominator)
    kept = [(a, b, c) for a, b, c in zip(d.tolist(), s.tolist(), t.tolist(), strict=True) if b != c]
    n_shape, n_texture = sum(a == b for a, b, _ in kept), sum(a == c for a, _, c in kept)
    den = n if denominator == "all" else len(kept)
    assert got == pytest.approx({"shape_bias": n_shape / (n_shape + n_texture), "n_shape": n_shape,
                                 "n_texture": n_texture, "n_other": len(kept) - n_shape - n_texture,
                                 "n_images": len(kept), "n_excluded": n - len(kept), "shape_match": n_shape / den,
                                 "texture_match": n_texture / den})


def test_imagenet_to_16_averages_each_categorys_classes_as_a_list_index_does():
    logits = torch.randn(5, 1000, generator=torch.Generator().manual_seed(0))
    p = logits.double().softmax(-1)
    want = torch.stack([p[:, list(R.IMAGENET_16_INDICES[c])].mean(1) for c in R.CATEGORIES_16], 1)
    assert torch.equal(R.imagenet_to_16(logits), want)


def test_the_probes_are_fitted_on_the_analysis_device(monkeypatch):
    """A GPU study's probes are fitted there (`fit_probe(device=...)`; the CPU path otherwise): the analysis hands
    the fit its ``device`` (the study's model device, whatever device a resumed part's features were on)."""
    import vitscope.metrics.robustness as MR

    seen = []
    real = MR.fit_probe

    def record(*args, **kw):
        seen.append(kw.get("device"))
        return real(*args, **kw)

    monkeypatch.setattr(MR, "fit_probe", record)
    train = SyntheticShapes(n=60, seed=1, variant="texture-bound")
    cue = SyntheticShapes(n=20, seed=2, variant="cue-conflict")
    xtr, ytr, _ = _colour_histograms(train, 60)
    xcue, ycue, tcue = _colour_histograms(cue, 20)
    an = ShapeBias(_info(), test_every=5)
    an.datasets = {"data": "cue", "train": "train"}
    an.configure({"data": list(range(12)), "train": list(range(12))})
    _feed_vectors(an, xtr, ytr, None, "train")
    _feed_vectors(an, xcue, ycue, tcue, "cue")
    an.device = torch.device("meta")  # no GPU here: a device the CPU path ignores, to see it handed over
    an.finalize()
    assert seen and all(d == torch.device("meta") for d in seen), seen


def test_a_head_stated_to_output_the_datasets_classes_is_read_as_they_are():
    """head_classes 'dataset': logit k is the dataset's class k (a model fine-tuned on the user's own classes): the
    same head rows as the known CIFAR-10 space on CIFAR-10's classes; a head of another size is one sentence."""
    from vitscope.analyses.robustness._common import head_covers, head_scores
    from vitscope.models.load import load_model

    sup = load_model("zoo-sup")
    data = _Cifar(20)
    tables = {}
    for space in ("cifar10", "dataset"):
        an = Corruptions(sup, corruptions=["contrast"], severities=[5], layers=[-1], test_every=2,
                         head_classes=space, readout="head")
        run_passes(an, sup, {"data": data}, batch_size=20)
        tables[space] = an.finalize().drop(columns=["model"])
    pd.testing.assert_frame_equal(tables["cifar10"], tables["dataset"])
    assert head_covers("dataset", ["a", "b"]) and not head_covers("dataset", None)
    with pytest.raises(ConfigError, match="10 logits for the dataset's 12 classes"):
        head_scores("dataset", list(SyntheticShapes().classes), torch.zeros(2, 10))
    an = Corruptions(sup, corruptions=["contrast"], severities=[5], head_classes="dataset")
    an.datasets = {"data": "synthetic-shapes"}
    with pytest.raises(ConfigError, match="head gives 10 logits for its 12 classes"):
        an.configure({"data": list(SyntheticShapes().classes)})


def test_pre_corrupted_images_are_not_corrupted_again(tmp_path):
    """On a dataset of pre-corrupted images (format ``corrupted``) the corruptions analysis plans the clean view
    only: each image is scored under its own corruption, no generated corruption goes on top."""
    from vitscope.study.config import load_config
    from vitscope.study.plan import make_plan

    root = tmp_path / "cifar10-c"
    root.mkdir()
    np.save(root / "gaussian_noise.npy", np.zeros((10, 32, 32, 3), np.uint8))
    np.save(root / "labels.npy", np.arange(10) % 10)
    (tmp_path / "s.yaml").write_text(f"""
models: [{{name: vit_small_patch16_224, pretrained: false, kwargs: {{img_size: 32, patch_size: 8, embed_dim: 48,
          depth: 2, num_heads: 3, num_classes: 10}}}}]
datasets:
  c: {{name: corrupted, root: {root}}}
  clean: {{name: synthetic-shapes, n_images: 8}}
analyses:
  corruptions: {{dataset: c, readout: head, head_classes: cifar10, severities: [1, 3],
                corruptions: [gaussian_noise, contrast]}}
""")
    plan = make_plan(load_config(tmp_path / "s.yaml"))
    assert [ap.views for ap in plan.analyses] == [["clean"]]
    (tmp_path / "s.yaml").write_text((tmp_path / "s.yaml").read_text().replace("dataset: c,", "dataset: clean,"))
    assert len(make_plan(load_config(tmp_path / "s.yaml")).analyses[0].views) == 1 + 2 * 2  # generated there
