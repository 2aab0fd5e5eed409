"""Probe variants as the papers ran them: raw (unstandardised) features, Walmer et al. 2023 Table 6's 'no BN' rows,
and the streamed minibatch SGD probe (DINO, MAE, Walmer et al.), each against a reference written here."""

import math

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression

from conftest import tiny
from vitscope.analyses import get_analysis
from vitscope.capture import stream
from vitscope.data import SyntheticShapes
from vitscope.errors import ConfigError
from vitscope.metrics import semantics as S


def _scaled_blobs(n=240, seed=0, scales=(1e3, 1.0, 1e-3, 30.0), c=3, sep=1.5):
    """Gaussian classes in 4 features of very different scales (columns multiplied by ``scales``)."""
    g = torch.Generator().manual_seed(seed)
    centres = sep * torch.randn(c, len(scales), generator=g, dtype=torch.float64)
    y = torch.arange(n) % c
    x = (centres[y] + torch.randn(n, len(scales), generator=g, dtype=torch.float64)) * torch.tensor(scales)
    return x, y


def test_unstandardised_probe_equals_scikit_learn_on_the_raw_features():
    x, y = _scaled_blobs(scales=(3.0, 1.0, 0.5, 2.0))
    test = torch.arange(len(y)) % 4 == 0
    lam = 1e-2
    fit = S.fit_probe(x[~test], y[~test], x[test], y[test], standardize=False, weight_decay=lam, max_iter=5000)
    n = int((~test).sum())
    ref = LogisticRegression(C=1 / (2 * lam * n), tol=1e-10, max_iter=10000).fit(x[~test].numpy(), y[~test].numpy())
    logp = ref.predict_log_proba(x[test].numpy())
    assert np.array_equal(fit.scores.argmax(1).numpy(), logp.argmax(1))
    # the same optimum up to fit_probe's stopping rule (gradient <= 1e-4): probabilities within 2e-3
    assert np.allclose(np.exp(fit.scores.numpy()), np.exp(logp), atol=2e-3)
    assert np.allclose(fit.scores.numpy(), logp, rtol=5e-3, atol=1e-2)


def test_standardising_changes_the_fit_on_features_of_very_different_scales():
    """The class signal sits in a feature of scale 1e-3: raw, the weight decay cannot afford the weight it needs;
    standardised, it is as cheap as any other."""
    g = torch.Generator().manual_seed(3)
    n = 300
    y = torch.arange(n) % 2
    signal = (2.0 * y - 1) + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)
    noise = torch.randn(n, 3, generator=g, dtype=torch.float64) * torch.tensor([1e3, 1.0, 30.0])
    x = torch.cat([noise, 1e-3 * signal[:, None]], 1)
    test = torch.arange(n) % 5 == 0
    raw = S.fit_probe(x[~test], y[~test], x[test], y[test], standardize=False, weight_decay=1e-2, max_iter=2000)
    std = S.fit_probe(x[~test], y[~test], x[test], y[test], standardize=True, weight_decay=1e-2, max_iter=2000)
    assert std.accuracy > 0.95
    assert raw.accuracy < 0.75
    assert not torch.allclose(raw.scores, std.scores, atol=1e-2)


def test_the_analysis_passes_standardize_to_the_probe(monkeypatch):
    seen = []
    real = S.fit_probe

    def spy(*a, **kw):
        seen.append(kw["standardize"])
        return real(*a, **kw)

    monkeypatch.setattr(S, "fit_probe", spy)
    vm = tiny("vit")
    for flag in (False, True):
        seen.clear()
        a = get_analysis("semantics")(vm, layers=[1], views=["cls"], ks=(3,), kmeans=False, probe_tune=False,
                                      standardize=flag)
        stream(vm, SyntheticShapes(n=30, seed=4).batches(10, vm.preprocessing), [a], progress=False)
        a.finalize()
        assert seen and set(seen) == {flag}


# ---------------------------------------------------------------- the SGD probe

def _separable(n=400, d=16, c=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    centres = 6 * torch.randn(c, d, generator=g)
    y = torch.arange(n) % c
    x = (centres[y] + torch.randn(n, d, generator=g) + 4).half()  # a float16 store, offset from 0
    return x, y, torch.arange(n) % 5 == 0


def test_sgd_probe_separates_a_linearly_separable_set_and_its_loss_decreases():
    x, y, test = _separable()
    fit = S.fit_probe_sgd(x, y, test, epochs=5, batch=32, lr=0.1, seed=1)
    assert fit.accuracy == 1.0
    assert fit.solver == "sgd" and fit.converged
    assert fit.iterations == 5 * math.ceil(int((~test).sum()) / 32)
    assert len(fit.losses) == 5 and fit.losses[-1] < fit.losses[0] / 10
    assert all(b <= a for a, b in zip(fit.losses, fit.losses[1:], strict=False))
    raw = S.fit_probe_sgd(x, y, test, epochs=5, batch=32, lr=1e-3, seed=1, standardize=False)
    assert raw.accuracy == 1.0 and raw.losses[-1] < raw.losses[0]


def test_sgd_probe_is_deterministic_for_a_seed():
    x, y, test = _separable(n=200)
    kw = dict(epochs=2, batch=16, lr=0.05)
    a, b = S.fit_probe_sgd(x, y, test, seed=7, **kw), S.fit_probe_sgd(x, y, test, seed=7, **kw)
    assert torch.equal(a.scores, b.scores) and a.losses == b.losses
    c = S.fit_probe_sgd(x, y, test, seed=8, **kw)
    assert not torch.equal(a.scores, c.scores)


def test_sgd_probe_reads_the_store_a_minibatch_at_a_time_and_uses_every_training_row(monkeypatch):
    x, y, test = _separable(n=103)
    reads = []
    real = S.read_rows

    def counting(store, idx, device):
        assert store is x  # the store itself, never a copy of it
        reads.append(idx.clone())
        return real(store, idx, device)

    monkeypatch.setattr(S, "read_rows", counting)
    epochs, batch = 3, 8
    S.fit_probe_sgd(x, y, test, epochs=epochs, batch=batch, standardize=False)
    assert max(len(r) for r in reads) <= batch
    train = set(torch.nonzero(~test).flatten().tolist())
    n_train = len(train)
    steps = math.ceil(n_train / batch)
    training = reads[:epochs * steps]
    for e in range(epochs):  # each epoch: every training row exactly once
        rows = torch.cat(training[e * steps:(e + 1) * steps]).tolist()
        assert sorted(rows) == sorted(train)
    scored = torch.cat(reads[epochs * steps:]).tolist()
    assert sorted(scored) == torch.nonzero(test).flatten().tolist()


def _reference_sgd(x, y, test, *, epochs, batch, lr, momentum, weight_decay, schedule, seed, standardize):
    """Minibatch SGD written with autograd and torch.optim.SGD: the init and the order as documented
    (weights N(0, 0.01^2) then one randperm per epoch from one generator), the learning rate set per step."""
    xs = x.float()
    train, tst = torch.nonzero(~test).flatten(), torch.nonzero(test).flatten()
    classes = torch.unique(y[train])
    pos = torch.searchsorted(classes, y)
    if standardize:
        xd = x[train].double()
        mu, sd = xd.mean(0).float(), xd.std(0, correction=1).float()
    else:
        mu, sd = torch.zeros(x.shape[1]), torch.ones(x.shape[1])
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(x.shape[1], len(classes), generator=g) * 0.01)
    b = torch.nn.Parameter(torch.zeros(len(classes)))
    opt = torch.optim.SGD([{"params": [w], "weight_decay": weight_decay}, {"params": [b], "weight_decay": 0.0}],
                          lr=lr, momentum=momentum)
    n = len(train)
    per_epoch = math.ceil(n / batch)
    total = per_epoch * epochs
    step = 0
    for epoch in range(epochs):
        order = train[torch.randperm(n, generator=g)]
        for s in range(0, n, batch):
            rows = order[s:s + batch]
            if schedule == "cosine":
                now = lr * 0.5 * (1 + math.cos(math.pi * step / total))
            else:
                now = lr * 0.1 ** ((epoch >= 0.6 * epochs) + (epoch >= 0.8 * epochs))
            for group in opt.param_groups:
                group["lr"] = now
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(((xs[rows] - mu) / sd) @ w + b, pos[rows])
            loss.backward()
            opt.step()
            step += 1
    with torch.no_grad():
        return torch.log_softmax(((xs[tst] - mu) / sd) @ w + b, 1)


@pytest.mark.parametrize("schedule,standardize,epochs", [("cosine", True, 1), ("step", False, 5)])
def test_sgd_probe_equals_a_hand_written_minibatch_loop(schedule, standardize, epochs):
    g = torch.Generator().manual_seed(11)
    n, d = 37, 6
    y = torch.randint(0, 3, (n,), generator=g)
    x = (torch.randn(n, d, generator=g) * 2 + 1).half()
    test = torch.arange(n) % 4 == 0
    kw = dict(epochs=epochs, batch=5, lr=0.05, momentum=0.9, weight_decay=1e-2, schedule=schedule, seed=3,
              standardize=standardize)
    fit = S.fit_probe_sgd(x, y, test, **kw)
    ref = _reference_sgd(x, y, test, **kw)
    classes = torch.unique(y[~test])
    assert torch.allclose(fit.scores[:, classes].float(), ref, atol=1e-5)


def test_sgd_options_are_one_sentence_errors():
    for bad in (dict(lr=0.0), dict(momentum=1.0), dict(weight_decay=-1.0), dict(schedule="linear"),
                dict(epochs=0), dict(batch=0)):
        with pytest.raises(ConfigError, match="sgd_"):
            S.sgd_options("semantics", **bad)
    vm = tiny("vit")
    with pytest.raises(ConfigError, match="probe_solver"):
        get_analysis("semantics")(vm, probe_solver="adam")


def test_semantics_sgd_probe_streams_the_pooled_store(monkeypatch):
    vm = tiny("vit")
    reads = []
    real = S.read_rows

    def counting(store, idx, device):
        reads.append((store.dtype, len(idx)))
        return real(store, idx, device)

    monkeypatch.setattr(S, "read_rows", counting)
    a = get_analysis("semantics")(vm, layers=[1, 2], views=["cls"], ks=(3,), kmeans=False, probe_solver="sgd",
                                  sgd_epochs=2, sgd_batch=7)
    stream(vm, SyntheticShapes(n=30, seed=4).batches(10, vm.preprocessing), [a], progress=False)
    df = a.finalize()
    assert reads and max(n for _, n in reads) <= 7
    assert torch.float16 in {dt for dt, _ in reads}  # the layers' memory-mapped float16 store
    probe = df[df.metric.str.startswith("probe_top1")]
    assert len(probe) == 3 and (probe.solver == "sgd").all()  # two layers and the chance row
    n_train = int(probe.n_train.iloc[0])
    assert (probe.probe_iterations == 2 * math.ceil(n_train / 7)).all()
    # the same numbers as the function on the store, seeded by the analysis's seed
    t = a.tables["cls"]
    y, test = t.column("labels"), a._splits()["cls"]
    ref = S.fit_probe_sgd(t.layer(1), y, test, epochs=2, batch=7, seed=0, num_classes=int(y.max()) + 1)
    row = probe[(probe.layer == 2) & (probe.metric == "probe_top1")]
    assert row.value.item() == pytest.approx(ref.accuracy)
    assert {"value_lo", "value_hi", "stderr", "chance"} <= set(row.dropna(axis=1).columns)


@pytest.mark.filterwarnings("ignore::vitscope.errors.ResultWarning")
def test_shape_bias_passes_standardize_to_its_probes(monkeypatch):
    from test_robustness import _feed_vectors, _info

    from vitscope.analyses.robustness.shape_bias import ShapeBias
    from vitscope.metrics import robustness as R

    seen = []
    real = R.fit_probe

    def spy(*a, **kw):
        seen.append(kw["standardize"])
        return real(*a, **kw)

    monkeypatch.setattr(R, "fit_probe", spy)
    y = torch.arange(60) % 3
    for flag in (False, True):
        seen.clear()
        an = ShapeBias(_info(), test_every=5, standardize=flag)
        an.datasets = {"data": "cue", "train": "train"}
        an.configure({"data": list(range(3)), "train": list(range(3))})
        _feed_vectors(an, torch.eye(3)[y] + 0.1 * torch.randn(60, 3), y, None, "train")
        _feed_vectors(an, torch.eye(3)[y], y, (y + 1) % 3, "cue")
        an.finalize()
        assert seen and set(seen) == {flag}
    with pytest.raises(ConfigError, match="standardize"):
        ShapeBias(_info(), standardize="no")
