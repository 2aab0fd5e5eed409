"""Accuracy under perturbed views of the clean images (`vitscope.analyses.robustness`): frequency-band
noise and common corruptions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd
import torch

from vitscope.analyses.base import register_analysis
from vitscope.analyses.robustness._common import (
    PROBE_COLUMNS,
    Bands,
    Severity,
    _clean_columns,
    _parse_view,
    _reason_of,
    _Robustness,
    _with_reason,
    chance_reason,
    decision_rows,
)
from vitscope.bounds import NonNegative, Positive
from vitscope.data import perturb as P
from vitscope.errors import ConfigError
from vitscope.host import on_device, on_host
from vitscope.metrics import robustness as R
from vitscope.metrics import semantics as S


# ---------------------------------------------------------------- accuracy under perturbed views
class _ViewAccuracy(_Robustness):
    """Accuracy of each readout on the clean test images and on each perturbed view of them."""

    def update(self, feats: Mapping[str, torch.Tensor], batch: Any) -> None:
        self._ensure_configured(batch)
        view = str(getattr(batch, "view", "clean") or "clean")
        take = min(self.max_images - self.seen.get(view, 0), len(batch))
        if take <= 0:
            return
        labels = on_host(batch.labels)[:take].long()
        if view == "clean" and batch.extra.get("corruption") is not None:  # pre-corrupted images (CorruptedFolder)
            self._add_precorrupted(feats, batch, take, labels)
            return
        is_test = self._is_test(batch, take)
        if view == "clean":
            self.n_images += take
        if self.use_head:  # before the probe's copy to the host: a tally on the device
            d, c = self._head_decisions(feats, take)
            self._add_tally(view, R.accuracy_tally(d, on_device(labels, d.device), c))
        if self.use_probe:  # every image: the split is decided in finalize, and only test images are scored
            self._add_pooled(view, feats, batch, take, labels, is_test)
        self.seen[view] = self.seen.get(view, 0) + take

    def _add_precorrupted(self, feats: Mapping[str, torch.Tensor], batch: Any, take: int, labels: torch.Tensor
                          ) -> None:
        """Images that come corrupted (``batch.extra['corruption' / 'severity']``): each group is scored like the
        view that would have made it, by the head (no clean images of the same set exist for a probe)."""
        if not self.use_head:
            raise ConfigError(f"{self.name}: {self.datasets.get('data') or 'the dataset'} holds pre-corrupted images, "
                              f"which only a classifier head covering its classes can score; {self.model_name} has "
                              f"{'no such head' if self.head_space is None else 'a ' + self.head_space + ' head'}"
                              " (or the dataset's classes are unknown)")
        names = list(batch.extra["corruption"][:take])
        d, c = self._head_decisions(feats, take)
        sev = on_device(torch.as_tensor(batch.extra["severity"])[:take], d.device)
        kinds = list(dict.fromkeys(names))
        kind = on_device(torch.tensor([kinds.index(n) for n in names]), d.device)
        y = on_device(labels, d.device)
        for k, name in enumerate(kinds):  # every severity of the names seen: views without images are left out
            for s in P.SEVERITIES:
                self._add_tally(P.corruption_key(name, s), R.accuracy_tally(d, y, c, (kind == k) & (sev == s)))
        self.seen["clean"] = self.seen.get("clean", 0) + take
        self.n_images += take

    def _accuracies(self) -> list[dict[str, Any]]:
        """Rows (readout, layer, view, accuracy, n_images) for every view seen."""
        out: list[dict[str, Any]] = []
        views = [v for v in self._view_order() if v in self.heads or v in self.tables]
        for v in views:
            if v in self.heads:
                acc, n, chance = R.accuracy_of_tally(self.heads[v])
                if n:  # none: a severity of a pre-corrupted name that no image had
                    out.append({"readout": "head", "layer": None, "view": v, "value": acc, "n_images": n,
                                "chance": chance})
        clean = self.tables.get("clean")
        if self.use_probe and clean is not None and len(clean) > 1:
            y, test = clean.column("labels"), self._split(clean)
            if self._check_split(y, test):
                test_ids = clean.column("ids")[test]
                tests = {"clean": (lambda j: clean.layer(j)[test], y[test])}
                for v in views:
                    if v != "clean" and v in self.tables:
                        t = self.tables[v]
                        keep = t.column("is_test") if self.own_split else torch.isin(t.column("ids"), test_ids)
                        tests[v] = ((lambda j, t=t, keep=keep: t.layer(j)[keep]), t.column("labels")[keep])
                c = self._num_classes(y)
                sizes = {"n_train": int((~test).sum()), "n_test": int(test.sum())}
                chance = S.majority_rate(y[~test], y[test])
                for j, layer in enumerate(self.layers):
                    xtr = clean.layer(j)[~test]
                    decs, cols = self._probe(xtr, y[~test], [f(j) for f, _ in tests.values()], c)
                    for (v, (_, yv)), d in zip(tests.items(), decs, strict=True):
                        out.append({"readout": "probe", "layer": layer, "view": v, "value": R.accuracy(d, yv),
                                    "n_images": len(yv), "chance": chance, **sizes, **cols})
        return out

    def _view_order(self) -> list[str]:
        seen = list(dict.fromkeys([*self.heads, *self.tables]))
        return ["clean"] + [v for v in seen if v != "clean"]

    @staticmethod
    def _clean(acc: list[dict[str, Any]]) -> dict[tuple[str, Any], dict[str, Any]]:
        """Per (readout, layer): the clean accuracy row, and ``reason`` (`chance_reason`) and ``extra`` (the
        columns of its own row) beside it."""
        out = {}
        for r in acc:
            if r["view"] == "clean":
                out[(r["readout"], r["layer"])] = {**r, "reason": chance_reason(r["value"], r["n_images"], r["chance"]),
                                                   "extra": _clean_columns(r["value"], r["n_images"], r["chance"])}
        return out


def _band_of(view: str) -> int | None:
    kind, args = _parse_view(view)
    return int(args["band"]) if kind == "band_noise" and "band" in args else None


@register_analysis
class BandNoise(_ViewAccuracy):
    """Accuracy under frequency-band noise (Park et al., "What do self-supervised ViTs learn?", ICLR 2023, after
    Park & Kim, "How do vision transformers work?", ICLR 2022), bands 0..``n_bands``-1 of width ``width`` (0.1 pi)
    from low to high frequency (`vitscope.data.perturb.band_noise`). ``band_definition``: ``circular_rms``
    (default): Gaussian noise filtered to an annulus of radial frequency, scaled to the same noise energy
    (``rms`` per pixel, images in [0, 1]) in every band; ``square_sign``: Park et al.'s public code, +-``eps``
    sign noise filtered to a square annulus of the shifted spectrum and not renormalised, so its energy grows
    with the band (3.7-4.9x from band 0 to bands 8-9 at 32 px). The default keeps the energy fixed so that a
    band's drop measures its frequency, not its larger noise; ``square_sign`` reproduces the source's numbers.
    Rows per (readout, layer, band): ``accuracy`` and ``drop`` (clean accuracy minus it, in accuracy points);
    ``band`` -1 is the clean accuracy; every row names its ``band_definition``. Each carries its 95 % interval
    (``value_lo``, ``value_hi``, ``stderr``) over its ``n_images``: an accuracy's Wilson interval
    (`R.accuracy_interval`), a drop's paired interval valid however the images' clean and noisy decisions go
    together (`R.drop_interval`). ``bands``: a subset of the bands to run (default all)."""

    name = "band_noise"
    description = "accuracy and its drop under noise confined to a frequency band, per band and layer"
    state_version = 6  # 6: every accuracy and drop with its 95 % interval (value_lo, value_hi, stderr); 5: the head's
    # decisions as tallies (`R.accuracy_tally`); 4: no drop from a readout at chance (reason); 3: stratified split,
    # tuned probe;
    # 2: band_definition (circular_rms | square_sign)

    def __init__(self, vm: Any, n_bands: Bands = P.N_BANDS, bands: Sequence[NonNegative] | None = None,
                 rms: Positive = 0.1, width: Positive = P.BAND_WIDTH, band_definition: str = "circular_rms",
                 eps: Positive = 0.1, **kw: Any):
        super().__init__(vm, **kw)
        self.params = {"n_bands": n_bands, "bands": bands, "rms": rms, "width": width,
                       "band_definition": band_definition, "eps": eps}
        type(self).views(self.params)  # validates

    @classmethod
    def views(cls, params: dict) -> list[str]:
        n = int(params.get("n_bands", P.N_BANDS))
        bands = params.get("bands")
        bands = list(range(n)) if bands is None else [int(b) for b in bands]
        bad = [b for b in bands if not 0 <= b < n]
        if bad:
            raise ConfigError(f"band_noise: bands {bad} do not exist; with n_bands={n} the bands are 0..{n - 1}")
        rms, width = float(params.get("rms", 0.1)), float(params.get("width", P.BAND_WIDTH))
        definition = P.check_band_definition(params.get("band_definition", "circular_rms"))
        eps = float(params.get("eps", 0.1))
        if rms <= 0 or width <= 0 or eps <= 0:
            raise ConfigError("band_noise: rms, eps and width must be positive")
        if definition == "square_sign":  # its amplitude is eps; rms does not apply
            extra = f",definition=square_sign,eps={eps}"
        else:
            extra = f",rms={rms}" if rms != 0.1 else ""
        extra += f",width={width}" if width != P.BAND_WIDTH else ""
        return ["clean"] + [f"band_noise:band={b},n_bands={n}{extra}" for b in bands]

    @staticmethod
    def key_numbers(df: pd.DataFrame) -> pd.DataFrame:
        """Per model and readout (head; last-layer probe): clean accuracy, the drop in the lowest and the highest
        band, and the band that costs most."""
        rows = []
        for (model, decision), g in decision_rows(df).groupby(["model", "decision"], sort=False):
            acc = g[g.metric == "accuracy"].set_index("band")["value"]
            drop = g[g.metric == "drop"].set_index("band")["value"].sort_index()
            if drop.empty:
                continue
            rows.append({"model": model, "readout": decision, "clean accuracy": acc.get(-1, float("nan")),
                         f"drop, band {int(drop.index[0])} (low)": drop.iloc[0],
                         f"drop, band {int(drop.index[-1])} (high)": drop.iloc[-1],
                         "worst band": int(drop.astype(float).idxmax()) if drop.notna().any() else None,
                         "worst drop": drop.max(), "reason": _reason_of(g)})
        return pd.DataFrame(rows)

    def finalize(self) -> pd.DataFrame:
        rows = []
        acc = self._accuracies()
        clean = self._clean(acc)
        for r in acc:
            band = -1 if r["view"] == "clean" else _band_of(r["view"])
            base = {"layer": r["layer"], "readout": r["readout"], "band": band, "n_images": r["n_images"],
                    **{k: r[k] for k in PROBE_COLUMNS if k in r}}
            c = clean.get((r["readout"], r["layer"]), {"value": math.nan, "reason": None, "extra": {}})
            rows.append({**base, "metric": "accuracy", "value": r["value"],
                         **R.accuracy_interval(r["value"], r["n_images"]), **(c["extra"] if band == -1 else {})})
            if band != -1:
                drop = math.nan if c["reason"] else R.drop(c["value"], r["value"])
                iv = R.drop_interval(c["value"], r["value"], r["n_images"]) if not c["reason"] else {}
                rows.append({**base, "metric": "drop", "value": drop, "reason": c["reason"], **iv})
        df = _with_reason(self.tidy(rows))
        df["token_view"] = df["readout"].map({"probe": self.token_view, "head": None})
        n = int(self.params["n_bands"])
        width = float(self.params["width"])
        df["band_low"] = df["band"].map(lambda b: b * width / math.pi if b >= 0 else float("nan"))
        df["band_high"] = df["band"].map(lambda b: (b + 1) * width / math.pi if b >= 0 else float("nan"))
        df["n_bands"] = n
        df["band_definition"] = self.params["band_definition"]
        return df


def _corruption_of(view: str) -> tuple[str, int] | None:
    kind, args = _parse_view(view)
    return (args["name"], int(args["severity"])) if kind == "corruption" else None


@register_analysis
class Corruptions(_ViewAccuracy):
    """Accuracy under the common corruptions of ImageNet-C / CIFAR-10-C (Hendrycks & Dietterich, "Benchmarking
    Neural Network Robustness to Common Corruptions and Perturbations", ICLR 2019; what Merlin et al., "What
    happens during finetuning of ViTs: an invariance based investigation" (2023), correlate with what
    fine-tuning forgets), generated on the fly (`vitscope.data.perturb.corruption`).
    Rows per (readout, layer): ``accuracy`` per ``corruption`` (with its ``family``) and ``severity`` (0 = clean),
    ``relative_drop`` from clean per corruption and severity, ``mca`` (mean corruption accuracy over the
    corruptions and severities run) and ``mca_relative_drop``. Every ``accuracy`` and ``mca`` carries its 95 %
    interval (``value_lo``, ``value_hi``, ``stderr``) over its ``n_images`` (`R.accuracy_interval`: Wilson's,
    conservative for the mean). ``corruptions``: names, family names
    ('noise', 'blur', 'weather', 'digital', 'held-out') or 'common' (the 15 of ImageNet-C), ``severities``: of 1..5.
    ``backend``: 'auto' (torch versions where they exist, else the imagecorruptions-imaug package), 'native',
    'package'. ``table``: the constants, 'imagenet' (ImageNet-C's, made for 224-px images) or 'cifar'
    (CIFAR-10-C's, made for 32-px images; the native corruptions only). On a dataset of pre-corrupted images
    (format ``corrupted``: the CIFAR-10-C / CIFAR-100-C / ImageNet-C files), each image is scored by the head under
    its own corruption and severity, and nothing is generated on top: ``corruptions`` and ``severities`` do not
    apply there (the dataset's options pick the corruptions and levels it reads)."""

    #: formats whose images come perturbed (`vitscope.data.formats.robustness.CorruptedFolder`: each image's
    #: corruption and severity in the batch): the study passes them as they are, in the clean view only
    corrupted_formats: tuple[str, ...] = ("corrupted",)

    name = "corruptions"
    description = "accuracy under ImageNet-C / CIFAR-10-C corruptions at severities 1-5, mean corruption accuracy"
    state_version = 6  # 6: a pre-corrupted dataset in its clean view only (no corruption generated on top); 5: every
    # accuracy and the mca with its 95 % interval (value_lo, value_hi, stderr), mca rows with n_images; 4: the head's
    # decisions as tallies (`R.accuracy_tally`); 3: no relative drop from a readout at chance (reason)

    def __init__(self, vm: Any, corruptions: Any = "common", severities: Sequence[Severity] = P.SEVERITIES,
                 backend: str = "auto", table: str = "imagenet", **kw: Any):
        super().__init__(vm, **kw)
        self.params = {"corruptions": corruptions, "severities": severities, "backend": backend, "table": table}
        type(self)._names_and_severities(self.params)  # the backend is checked where corruptions are generated

    def probe_possible(self) -> tuple[bool, str]:
        if str(self.datasets.get("data") or "").startswith("corrupted"):
            return False, f"{self.datasets['data']} holds only corrupted images"
        return True, ""

    @staticmethod
    def corruption_names(which: Any) -> list[str]:
        which = [which] if isinstance(which, str) else list(which)
        out: list[str] = []
        for w in which:
            if w == "common":
                out += P.COMMON
            elif w == "all":
                out += P.CORRUPTIONS
            elif w in P.FAMILIES:
                out += P.FAMILIES[w]
            else:
                P.check_corruption(w, 1)
                out.append(w)
        return list(dict.fromkeys(out))

    @classmethod
    def _names_and_severities(cls, params: dict) -> tuple[list[str], list[int]]:
        """The corruption names and severities ``params`` ask for; one ConfigError sentence for a bad one."""
        try:
            names = cls.corruption_names(params.get("corruptions", "common"))
            sev = [int(s) for s in params.get("severities", P.SEVERITIES)]
            for s, raw in zip(sev, params.get("severities", P.SEVERITIES), strict=True):
                if s != raw or not 1 <= s <= 5:
                    raise ConfigError(f"corruptions: severity {raw!r} does not exist; severities are 1..5")
        except ConfigError:
            raise
        except Exception as e:  # VitscopeError from perturb: same sentence, config-time type
            raise ConfigError(f"corruptions: {e}") from e
        return names, sev

    @classmethod
    def views(cls, params: dict) -> list[str]:
        names, sev = cls._names_and_severities(params)
        try:
            backend, table = params.get("backend", "auto"), params.get("table", "imagenet")
            P.check_backend(names, backend, table)
        except ConfigError:
            raise
        except Exception as e:  # VitscopeError from perturb: same sentence, config-time type
            raise ConfigError(f"corruptions: {e}") from e
        b = ("" if backend == "auto" else f",backend={backend}") + ("" if table == "imagenet" else f",table={table}")
        return ["clean"] + [f"corruption:name={n},severity={s}{b}" for n in names for s in sev]

    @staticmethod
    def key_numbers(df: pd.DataFrame) -> pd.DataFrame:
        """Per model and readout (head; last-layer probe): clean accuracy, mean corruption accuracy, its
        relative drop, and the corruption that costs most (mean over severities)."""
        rows = []
        for (model, decision), g in decision_rows(df).groupby(["model", "decision"], sort=False):
            v = g[g.corruption.isna()].set_index("metric")["value"]
            acc = g[(g.metric == "accuracy") & (g.severity > 0)].groupby("corruption")["value"].mean()
            clean = g[(g.metric == "accuracy") & (g.severity == 0)]["value"]
            rows.append({"model": model, "readout": decision,
                         "clean accuracy": float(clean.iloc[0]) if len(clean) else float("nan"),
                         "mean corruption accuracy": v.get("mca", float("nan")),
                         "relative drop": v.get("mca_relative_drop", float("nan")),
                         "worst corruption": acc.idxmin() if len(acc) else None, "reason": _reason_of(g)})
        return pd.DataFrame(rows)

    def finalize(self) -> pd.DataFrame:
        rows = []
        acc = self._accuracies()
        clean = self._clean(acc)
        none = {"value": math.nan, "reason": None, "extra": {}}
        per: dict[tuple[str, Any], dict[tuple[str, int], float]] = {}
        for r in acc:
            key = (r["readout"], r["layer"])
            c = clean.get(key, none)
            cs = ("clean", 0) if r["view"] == "clean" else _corruption_of(r["view"])
            base = {"layer": r["layer"], "readout": r["readout"], "corruption": cs[0], "severity": cs[1],
                    "family": P.FAMILY_OF.get(cs[0], "clean"), "n_images": r["n_images"],
                    **{k: r[k] for k in PROBE_COLUMNS if k in r}}
            rows.append({**base, "metric": "accuracy", "value": r["value"],
                         **R.accuracy_interval(r["value"], r["n_images"]), **(c["extra"] if not cs[1] else {})})
            if cs[1]:
                per.setdefault(key, {})[cs] = r["value"]
                rows.append({**base, "metric": "relative_drop", "reason": c["reason"],
                             "value": math.nan if c["reason"] else R.relative_drop(c["value"], r["value"])})
        for (readout, layer), a in per.items():
            c = clean.get((readout, layer), none)
            s = R.corruption_summary(a, c["value"])
            n = c.get("n_images", 0)
            rows += [{"metric": k, "layer": layer, "readout": readout, "n_images": n,
                      **({"value": math.nan, "reason": c["reason"]} if c["reason"] and k != "mca" else {"value": v}),
                      **(R.accuracy_interval(v, n) if k == "mca" else {})}
                     for k, v in s.items()]
        df = _with_reason(self.tidy(rows))
        df["token_view"] = df["readout"].map({"probe": self.token_view, "head": None})
        return df
