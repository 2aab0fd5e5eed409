"""benchmarks/device.py, the prepared GPU check: its smoke form runs every section on the CPU and writes the keys
docs/DEVICE.md names; its table comparison (section a) fails on a perturbed table and passes on equal ones."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _device_module():
    spec = importlib.util.spec_from_file_location("device_check", ROOT / "benchmarks" / "device.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["device_check"] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


dc = _device_module()

TINY = """
models:
  - {name: vit_small_patch16_224, label: tiny-vit, pretrained: false,
     kwargs: {img_size: 32, patch_size: 8, embed_dim: 48, depth: 2, num_heads: 3}}
dataset: {name: synthetic-shapes, n_images: 24}
analyses:
  attention_distance: {}
  cka: {batch_size: 8, views: [gap]}
batch_size: 8
progress: false
"""


def _documented_keys() -> list[str]:
    """The JSON keys docs/DEVICE.md names, as dotted paths (`sections.b_throughput.by_dtype.*.pass_over_bare`)."""
    text = (ROOT / "docs" / "DEVICE.md").read_text()
    return sorted(set(re.findall(r"`((?:sections|environment)\.[a-z0-9_.*]+)`", text)))


def _lookup(obj, path: list[str]) -> bool:
    if not path:
        return True
    head, rest = path[0], path[1:]
    if head == "*":
        return isinstance(obj, dict) and bool(obj) and all(_lookup(v, rest) for v in obj.values()
                                                           if not (isinstance(v, dict) and "skipped" in v))
    return isinstance(obj, dict) and head in obj and _lookup(obj[head], rest)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("device")
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "device.py"), "--out", str(out), "--smoke"],
                       capture_output=True, text=True, timeout=600, cwd=out)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out, json.loads((out / "device.json").read_text())


def test_the_smoke_run_runs_every_section_on_the_cpu_and_writes_every_documented_key(smoke):
    out, res = smoke
    assert [k for k in res["sections"]] == list(dc.SECTIONS.values())
    assert {k: s["status"] for k, s in res["sections"].items()} == {k: "ok" for k in dc.SECTIONS.values()}
    keys = _documented_keys()
    assert len(keys) >= 15, keys  # the docs name the figures they explain
    missing = [k for k in keys if not _lookup(res, k.split("."))]
    assert not missing, missing
    md = (out / "device.md").read_text()
    assert all(f"## {k} (ok" in md for k in dc.SECTIONS.values())


def test_the_smoke_run_equals_itself_on_two_cpu_runs_and_under_torchrun(smoke):
    _, res = smoke
    a = res["sections"]["a_correctness"]
    assert a["passed"] and a["failures"] == []
    assert {"attention_distance", "cka", "semantics"} <= set(a["tables"])
    # the same study twice on the CPU is bit for bit the same: every difference is exactly zero
    assert all(t["worst_ratio"] == 0 for t in a["tables"].values())
    d = res["sections"]["d_torchrun"]
    assert d["verdict"] == "works" and d["equal_to_one_process"] is True and d["world_size"] == 2
    b = res["sections"]["b_throughput"]["by_dtype"]
    for dtype in ("fp32", "bf16"):
        assert b[dtype]["pass_seconds"] > 0 and b[dtype]["bare_seconds"] > 0
        assert 0 <= b[dtype]["data_wait_seconds"] < b[dtype]["pass_seconds"]
        assert b[dtype]["pass_over_bare"] == pytest.approx(b[dtype]["pass_seconds"] / b[dtype]["bare_seconds"],
                                                           rel=0.01)
    c = res["sections"]["c_pipeline"]
    assert all(r > 0 for r in c["images_per_s"].values()) and "0" in c["images_per_s"]
    e = res["sections"]["e_zoo_training"]
    assert all(v["steps_per_s"] > 0 for v in e["objectives"].values())


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """The same tiny study twice on the CPU, each from its own cold cache."""
    tmp = tmp_path_factory.mktemp("cmp")
    a, _, _ = dc._study(TINY, tmp, "one", ["device=cpu"])
    b, _, _ = dc._study(TINY, tmp, "two", ["device=cpu"])
    return a / "results", b / "results"


def _copy(results: Path, dest: Path) -> Path:
    dest.mkdir(parents=True)
    for p in results.rglob("*.parquet"):
        q = dest / p.relative_to(results)
        q.parent.mkdir(parents=True, exist_ok=True)
        q.write_bytes(p.read_bytes())
    return dest


def _edit(path: Path, fn) -> None:
    t = pd.read_parquet(path)
    fn(t)
    t.to_parquet(path)


def test_two_cpu_runs_compare_equal(two_runs):
    res = dc.compare_runs(*two_runs)
    assert res["ok"] and res["failures"] == []
    assert set(res["tables"]) >= {"attention_distance", "cka"}
    for t in res["tables"].values():
        assert all(m["max_abs_diff"] == 0 for m in t["metrics"].values())


def _distance_row(path: Path, k: int):
    """The table at ``path``, the index of its k-th attention-distance row and that metric's tolerance."""
    t = pd.read_parquet(path)
    return t, int(np.flatnonzero((t.metric == "distance").to_numpy())[k]), dc.tolerance("attention_distance",
                                                                                          "distance")


@pytest.mark.parametrize("how", ["over", "nan", "label", "row", "table"])
def test_a_perturbed_table_fails_the_comparison(two_runs, tmp_path, how):
    ref, other = two_runs
    other = _copy(other, tmp_path / "other")
    path = other / "attention_distance.parquet"
    t, i, tol = _distance_row(path, 3)
    if how == "over":  # just over the stated tolerance
        _edit(path, lambda t: t.__setitem__("value", t.value.where(t.index != i, t.value + 1.5 * (
            tol.atol + tol.rtol * abs(t.value[i])))))
    elif how == "nan":
        _edit(path, lambda t: t.__setitem__("value", t.value.where(t.index != i, np.nan)))
    elif how == "label":
        _edit(path, lambda t: t.__setitem__("model", t.model.where(t.index != i, "someone-else")))
    elif how == "row":
        t.drop(index=i).to_parquet(path)
    else:
        path.unlink()
    res = dc.compare_runs(ref, other)
    assert not res["ok"]
    assert len(res["failures"]) == 1 and res["failures"][0].startswith("attention_distance")
    assert res["tables"]["cka"]["ok"]  # the other tables still compare equal


def test_a_difference_within_the_tolerance_passes_and_is_reported(two_runs, tmp_path):
    ref, other = two_runs
    other = _copy(other, tmp_path / "other")
    path = other / "attention_distance.parquet"
    t, i, tol = _distance_row(path, 0)
    step = 0.5 * (tol.atol + tol.rtol * abs(t.value[i]))
    _edit(path, lambda t: t.__setitem__("value", t.value.where(t.index != i, t.value + step)))
    res = dc.compare_runs(ref, other)
    m = res["tables"]["attention_distance"]["metrics"]["distance"]
    assert res["ok"] and m["max_abs_diff"] == pytest.approx(step, rel=1e-6) and 0.4 < m["ratio"] < 0.6


def test_every_metric_has_a_stated_tolerance_of_its_kind():
    assert dc.tolerance("semantics", "knn20_top1").kind == "decision"
    assert dc.tolerance("shape_bias", "n_shape").atol == 2
    assert dc.tolerance("tsne", "tsne").kind == "chaotic" and not dc.tolerance("tsne", "tsne").judged
    assert dc.tolerance("stir", "cka").kind == "iterative"
    assert dc.tolerance("cka", "cka_minibatch").kind == "continuous"
    assert dc.tolerance("a_future_analysis", "anything").kind == "continuous"
    assert all(t.why for _, _, t in dc.TOLERANCES)


def test_bad_sections_and_a_missing_gpu_are_one_sentence(tmp_path):
    for argv, said in ((["--sections", "a,x"], "--sections takes letters among"),
                       (["--device", "cuda:7"], "no usable CUDA GPU")):
        if argv[0] == "--device" and dc.torch.cuda.is_available():
            continue
        p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "device.py"), "--out", str(tmp_path), *argv],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode != 0 and said in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.mark.parametrize("dtype", ["float64", "int64"])
def test_a_probes_iteration_count_is_reported_not_judged_while_its_accuracy_is(dtype):
    ref = pd.DataFrame({"model": ["m"] * 3, "metric": ["accuracy"] * 3, "value": [0.5, 0.6, 0.7],
                        "probe_iterations": np.array([10, 20, 30]).astype(dtype)})
    other = ref.copy()
    other["probe_iterations"] = np.array([11, 20, 30]).astype(dtype)  # another number of L-BFGS steps
    res = dc.compare_tables(ref, other, "band_noise")
    assert res["ok"] and res["diagnostics"] == {"probe_iterations": 1.0}
    other.loc[0, "value"] = 0.5 + 2 / 68  # two of 68 test images turned: over the decision tolerance
    res = dc.compare_tables(ref, other, "band_noise")
    assert not res["ok"] and res["metrics"]["accuracy"]["max_abs_diff"] == pytest.approx(2 / 68)


def test_tsne_coordinates_are_reported_and_never_fail_the_check():
    ref = pd.DataFrame({"model": ["m"] * 4, "metric": ["tsne"] * 4, "value": [np.nan] * 4,
                        "x": [0.0, 1.0, 2.0, 3.0], "y": [1.0, 0.0, 1.0, 0.0]})
    other = ref.assign(x=ref.x + 0.9)
    res = dc.compare_tables(ref, other, "tsne")
    m = res["metrics"]["tsne"]
    assert res["ok"] and m["kind"] == "chaotic" and m["max_abs_diff"] == pytest.approx(0.9) and m["cells_over"] == 4
