"""Which similarity findings survive a change of measure (`vitscope.findings`): the verdict per measure from the
pairs' intervals, each measure read in its declared direction (`vitscope.measures`); `vitscope findings RUN_DIR`
on a tiny study; `vitscope zoo findings` with and without a similarity table."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from study_fixtures import TINY_STUDY_KW, one_line_error

from vitscope.cli import main
from vitscope.findings import SUMMARY, check_measures
from vitscope.measures import DIRECTION, alike_sign, base, is_distance

FAM = {"c1": "contrastive", "c2": "contrastive", "m1": "reconstructive", "m2": "reconstructive", "r": "none"}
PAIRS_ALIKE = [("c1", "c2")]
PAIRS_THAN = [("c1", "m1"), ("m1", "c2"), ("c1", "m2"), ("c2", "m2")]  # (m1, c2): the table's other order


def _sim_row(a, b, metric, value, half=None, layer=1, view="gap"):
    row = {"model": a, "model_b": b, "metric": metric, "layer": layer, "layer_b": layer, "tap": f"block{layer}.out",
           "tap_b": f"block{layer}.out", "token_view": view, "value": value}
    if half is not None:
        row.update(value_lo=value - half, value_hi=value + half)
    return row


def _run_dir(root: Path, similarity: bool = True) -> Path:
    """A run of five models (depth 2: the last block is 1) whose tables make the CL~CL vs CL~MIM finding hold
    under mean CCA, fail under Procrustes, be inconclusive under the shape metric (overlapping intervals) and
    under mutual k-NN (no standard error given); ridge R² in both directions of each pair."""
    (root / "results").mkdir(parents=True)
    (root / "manifest.json").write_text(json.dumps(
        {"models": {m: {"objective_family": f, "depth": 2} for m, f in FAM.items()}}))
    rows = []
    for (a, b), alike in [*((p, True) for p in PAIRS_ALIKE), *((p, False) for p in PAIRS_THAN)]:
        rows += [
            _sim_row(a, b, "mean_cca", 0.9 if alike else 0.5, half=0.02),  # holds: CL~CL larger
            # a distance, CL~CL larger = less alike: fails (it would hold if read as a similarity)
            _sim_row(a, b, "procrustes", 0.9 if alike else 0.5, half=0.02),
            _sim_row(a, b, "angular_shape_alpha=0.5", 0.50 if alike else 0.52, half=0.2),  # overlapping: inconclusive
            _sim_row(a, b, "mutual_knn", 0.9 if alike else 0.1),  # no standard error given: inconclusive
            _sim_row(a, b, "ridge_r2", 0.8 if alike else 0.3, half=0.01),  # a predicts b
            _sim_row(a, b, "ridge_r2_reverse", 0.6 if alike else 0.1, half=0.01),  # b predicts a
            # an earlier block saying the opposite, and the pair's other taps: not the finding's
            _sim_row(a, b, "mean_cca", 0.1 if alike else 0.9, half=0.01, layer=0),
        ]
        rows.append({**_sim_row(a, b, "mean_cca", 0.0 if alike else 1.0, half=0.01), "tap": "block1.attn"})
    for m in FAM:  # within-model rows are not pairs of models
        rows.append(_sim_row(m, m, "procrustes", 0.0, half=0.0))
    if similarity:
        pd.DataFrame(rows).to_parquet(root / "results" / "similarity.parquet")
    cka = {("c1", "c2"): 0.9, ("c1", "m1"): 0.2, ("c1", "m2"): 0.4, ("c2", "m1"): 0.3, ("m2", "c2"): 0.5}
    pd.DataFrame([{"model": a, "model_b": b, "metric": "cka_minibatch", "token_view": "cls", "layer": 1,
                   "layer_b": 1, "tap": "block1.out", "tap_b": "block1.out", "value": v, "stderr": 0.01}
                  for (a, b), v in cka.items()]).to_parquet(root / "results" / "cka.parquet")
    return root


def test_a_finding_holds_fails_or_is_inconclusive_per_measure_in_each_measures_direction(tmp_path):
    t = check_measures(_run_dir(tmp_path)).set_index("measure")
    assert set(t.index) == {"cka_minibatch", "mean_cca", "procrustes", "angular_shape_alpha=0.5", "mutual_knn",
                            "ridge_r2"}
    assert set(t.finding) == {"two contrastive models are more alike than contrastive and MIM"}
    assert (t.n_alike.tolist(), t.n_than.tolist()) == ([1] * 6, [4] * 6)  # the model r (none) is in no pair
    cca = t.loc["mean_cca"]
    assert (cca.verdict, cca.alike, cca.than, cca.interval) == ("holds", pytest.approx(0.9), pytest.approx(0.5),
                                                                "jackknife")
    # the difference's interval: se 0.02 / 1.96 per pair, the four CL~MIM pairs averaged (independent)
    se = 0.02 / 1.959964 * np.sqrt(1 + 1 / 4)
    assert cca.difference_hi - cca.difference_lo == pytest.approx(2 * 1.959964 * se)
    proc = t.loc["procrustes"]
    assert (proc.verdict, proc.direction, proc.difference) == ("fails", "distance", pytest.approx(0.4))
    shape = t.loc["angular_shape_alpha=0.5"]
    assert shape.verdict == "inconclusive" and shape.difference_lo < 0 < shape.difference_hi
    knn = t.loc["mutual_knn"]
    assert (knn.verdict, knn.interval, knn.difference) == ("inconclusive", "none", pytest.approx(0.8))
    assert np.isnan(knn.difference_lo)
    ridge = t.loc["ridge_r2"]  # both directions of each pair averaged, whichever order the table holds it in
    assert (ridge.verdict, ridge.alike, ridge.than) == ("holds", pytest.approx(0.7), pytest.approx(0.2))
    cka = t.loc["cka_minibatch"]
    assert (cka.verdict, cka.interval, cka.token_view, cka.table) == ("holds", "stderr", "cls", "cka")
    assert cka.than == pytest.approx((0.2 + 0.4 + 0.3 + 0.5) / 4)


def test_families_given_by_the_caller_override_the_manifests(tmp_path):
    run = _run_dir(tmp_path)
    # m2 counted contrastive: CL~CL pairs c1~c2, c1~m2, c2~m2 (0.9, 0.5, 0.5) against c1~m1, m1~c2 (0.5, 0.5)
    t = check_measures(run, {"m2": "contrastive"}).set_index("measure")
    assert (t.loc["mean_cca"].n_alike, t.loc["mean_cca"].n_than) == (3, 2)
    assert t.loc["mean_cca"].alike == pytest.approx((0.9 + 0.5 + 0.5) / 3)
    assert check_measures(run, {"c2": "none"}).empty  # one contrastive model: no CL~CL pair


def test_every_measure_the_similarity_analysis_writes_has_a_declared_direction():
    import torch

    from vitscope.analyses.similarity import _is_distance
    from vitscope.metrics import similarity as M

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(30, 8, generator=g), torch.randn(30, 6, generator=g)
    got = M.compare(M.prepare(x, M.MEASURES, k=3, rsa_images=20), M.prepare(y, M.MEASURES, k=3, rsa_images=20),
                    M.MEASURES)
    names = [*got, "ridge_r2_reverse", "pwcca_reverse", "cka_minibatch", "cka_divergence"]
    for name in names:
        assert base(name) in DIRECTION, name
        assert alike_sign(name) == (-1 if is_distance(name) else 1)
        if not name.startswith("cka"):  # the analysis' own test of a distance (its p-values) agrees
            assert _is_distance(name) == is_distance(name), name
    assert is_distance("procrustes") and is_distance("angular_shape_alpha=0") and not is_distance("cknna")
    with pytest.raises(KeyError):
        alike_sign("knn20_top1")


def test_zoo_findings_print_the_per_measure_table_with_a_similarity_table_and_say_how_to_get_one(tmp_path, capsys):
    run = _run_dir(tmp_path / "with")
    assert main(["zoo", "findings", str(run)]) == 0
    out = capsys.readouterr().out
    assert "| CKA of the last blocks (CLS): CL~CL vs CL~MIM pairs (CL > MIM) |" in out  # the zoo's own table
    assert "| procrustes | gap | smaller | 0.9 | 0.5 | +0.4 (" in out and "| **fails** |" in out
    assert "| mutual_knn | gap | larger | 0.9 | 0.1 | +0.8 (no interval) | inconclusive |" in out
    assert pd.read_parquet(run / SUMMARY).verdict.tolist().count("holds") == 3  # CKA, mean CCA, ridge R²
    bare = _run_dir(tmp_path / "without", similarity=False)
    assert main(["zoo", "findings", str(bare)]) == 0
    out = capsys.readouterr().out
    assert "rests on CKA alone in this run: add `similarity: {}` under `analyses:`" in out
    assert "| procrustes" not in out and not (bare / SUMMARY).exists()


def test_findings_command_on_a_tiny_study(tmp_path, capsys, monkeypatch):
    """Three random tiny ViTs (families given on the command line), CKA and the similarity analysis: the table
    prints, one row per measure, and lands in results/summary/findings.parquet."""
    monkeypatch.setattr("vitscope.report.write_report", lambda run_dir: None)  # its figures: seconds, not needed
    models = "".join(f"  - {{name: vit_small_patch16_224, label: {m}, pretrained: false, seed: {i}, "
                     f"kwargs: {TINY_STUDY_KW}}}\n" for i, m in enumerate(("c1", "c2", "m1")))
    (tmp_path / "study.yaml").write_text(f"""
models:
{models}dataset: {{name: synthetic-shapes, n_images: 16}}
analyses:
  cka: {{batch_size: 8, views: [gap]}}
  similarity: {{measures: [procrustes, mean_cca, mutual_knn], alphas: [0.5], n_subset: 16, k: 3, rsa_images: 8,
                n_permutations: 0, n_groups: 3}}
batch_size: 8
progress: false
output_dir: {tmp_path / 'run'}
""")
    assert main(["-q", "run", str(tmp_path / "study.yaml")]) == 0
    capsys.readouterr()
    run = str(tmp_path / "run")
    families = ["--family", "c1=contrastive", "--family", "c2=contrastive", "--family", "m1=reconstructive"]
    assert main(["findings", run, *families]) == 0
    out = capsys.readouterr().out
    assert "two contrastive models are more alike than contrastive and MIM [Walmer et al. 2023, Fig. 19]" in out
    assert "| measure | view | more alike | CL~CL | CL~MIM | CL~CL - CL~MIM (95 % interval) | verdict |" in out
    t = pd.read_parquet(tmp_path / "run" / SUMMARY)
    assert set(t.measure) == {"cka_minibatch", "procrustes", "mean_cca", "mutual_knn"}
    assert set(t.verdict) <= {"holds", "fails", "inconclusive"}
    assert t.set_index("measure").loc["procrustes", "interval"] == "jackknife"  # the last blocks
    assert t.set_index("measure").loc["mutual_knn", "interval"] == "jackknife"  # the neighbour measures too
    assert t.set_index("measure").loc["mutual_knn", "verdict"] == "inconclusive"
    for m, _ in t.groupby("measure"):
        assert f"| {m} | gap |" in out
    # the table vitscope findings wrote is vitscope's own: the same study runs again into the folder, and with
    # --overwrite, and the file stays out of the way (issue 41: it was refused as a foreign file)
    assert main(["-q", "run", str(tmp_path / "study.yaml")]) == 0
    assert main(["-q", "run", str(tmp_path / "study.yaml"), "--overwrite"]) == 0
    capsys.readouterr()
    # the manifest knows no family of these random models: one sentence naming --family
    assert "--family LABEL=contrastive" in one_line_error(capsys, ["findings", run])
    said = one_line_error(capsys, ["findings", run, "--family", "c=contrastive"])
    assert "unknown model label 'c'; did you mean" in said


@pytest.mark.parametrize("what,needle", [("missing", "is not a directory"), ("empty", "has no manifest.json"),
                                         ("no tables", "holds neither results/cka.parquet")])
def test_findings_of_a_bad_run_dir_is_one_sentence_exit_2(tmp_path, capsys, what, needle):
    run = tmp_path / "run"
    if what != "missing":
        run.mkdir()
    if what == "no tables":
        (run / "manifest.json").write_text(json.dumps({"models": {m: {"objective_family": f} for m, f in FAM.items()}}))
    assert needle in one_line_error(capsys, ["findings", str(run)])


def test_findings_command_imports_no_torch(tmp_path):
    run = _run_dir(tmp_path)
    src = str(Path(__file__).resolve().parents[1] / "src")
    code = ("import sys\nfrom vitscope.cli import main\nrc = main(sys.argv[1:])\n"
            "print('HEAVY', [m for m in ('torch', 'timm', 'matplotlib', 'sklearn') if m in sys.modules], 'RC', rc)")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-c", code, "findings", str(run)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.stdout.strip().splitlines()[-1] == "HEAVY [] RC 0", p.stderr[-2000:]
