"""The self-contained HTML report of a run directory: summary, models side by side, then per analysis its
description, key numbers and figures (PNG inline, with captions). Needs nothing but the run directory:
`vitscope report RUN_DIR` rebuilds it from the cached tables without touching any model."""

from __future__ import annotations

import base64
import hashlib
import html
import io
import json
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from vitscope.files import write_atomic
from vitscope.report.figures import FIGURES
from vitscope.threads import single_threaded

_CSS = """body{font-family:system-ui,sans-serif;max-width:1150px;margin:2em auto;padding:0 1em;color:#222;
line-height:1.4}h1{font-size:1.6em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2.2em}
figure{display:inline-block;margin:.6em;vertical-align:top;max-width:100%}
figure img{max-width:100%}figcaption{font-size:.85em;color:#555;max-width:34em}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0}
td,th{border:1px solid #ddd;padding:.25em .5em;text-align:left}
th{background:#f6f6f6}code{background:#f4f4f4;padding:0 .2em}.muted{color:#777;font-size:.9em}
nav a{margin-right:1em}"""


def _png(fig: plt.Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _esc(x: object) -> str:
    return html.escape(str(x))


def key_numbers(df: pd.DataFrame) -> pd.DataFrame:
    """Per metric and model (pairwise rows left out): the mean over layers/heads, the last layer's mean and
    the layer where the metric peaks. A compact table; the parquet file has everything."""
    d = df
    if "model_b" in d.columns:
        d = d[d["model_b"].isna() | (d["model_b"] == d["model"])]
    d = d[pd.to_numeric(d["value"], errors="coerce").notna()]
    if d.empty:
        return pd.DataFrame()
    rows = []
    for (metric, model), g in d.groupby(["metric", "model"], sort=False):
        row = {"metric": metric, "model": model, "mean": g["value"].astype(float).mean()}
        layers = pd.to_numeric(g["layer"], errors="coerce")
        if layers.notna().any():
            per_layer = g.assign(layer=layers).groupby("layer")["value"].mean()
            row["last layer"] = per_layer.iloc[-1]
            row["peak layer"] = int(per_layer.idxmax())
        rows.append(row)
    out = pd.DataFrame(rows)
    return out.head(60)


def _table(df: pd.DataFrame) -> str:
    if df.empty:
        return ""
    cols = list(df.columns)
    body = "".join("<tr>" + "".join(f"<td>{_fmt(r[c])}</td>" for c in cols) + "</tr>" for _, r in df.iterrows())
    return "<table><tr>" + "".join(f"<th>{_esc(c)}</th>" for c in cols) + f"</tr>{body}</table>"


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return "" if pd.isna(v) else f"{v:.4g}"
    return _esc(v)


def _dense_summary(run_dir: Path, results: list[Path], models: dict) -> list[str]:
    """The best-layer summary of the dense downstream tasks: written to results/summary/best_layers.parquet
    (derived from the tasks' tables, rebuilt with the report; in a subfolder, so the study's check that results/
    holds exactly its analyses' tables is unaffected) and shown as a table and a task x model heat table."""
    from vitscope.report.figures.dense import TASKS, best_layer_summary, summary_figure

    tables = {p.stem: pd.read_parquet(p) for p in results if p.stem in TASKS}
    summary = best_layer_summary(tables, models) if tables else pd.DataFrame()
    if summary.empty:
        return []
    (run_dir / "results" / "summary").mkdir(parents=True, exist_ok=True)
    summary.to_parquet(run_dir / "results" / "summary" / "best_layers.parquet", index=False)
    shown = summary[["label", "model", "supervision", "best_layer", "token_view", "score", "last_layer_score",
                     "random_init_score", "chance"]].rename(columns={"label": "task"})
    out = ["<h2 id='best_layers'>Dense downstream tasks: best layer</h2>",
           "<p>Which block of which model is best for local tasks with no training (after Walmer et al., "
           "&ldquo;Teaching Matters: Investigating the Role of Supervision in Vision Transformers&rdquo;, CVPR "
           "2023, Table 1), beside the last block, a random-init model of the same architecture in this study "
           "and the task's chance level. Table: <code>results/summary/best_layers.parquet</code>.</p>", _table(shown)]
    for title, fig in summary_figure(summary):
        out.append(f"<figure><img alt='{_esc(title)}' src='data:image/png;base64,{_png(fig)}'>"
                   f"<figcaption>{_esc(title)}</figcaption></figure>")
    return out


@single_threaded  # drawing and small tables: nothing gains from a second thread, and none may spin
def results_digest(run_dir: str | Path) -> dict[str, str]:
    """``{table: sha256}`` of the run's results files: what `report_digest` of a report drawn from them says."""
    files = sorted(Path(run_dir, "results").glob("*.parquet"))
    return {p.stem: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def report_digest(run_dir: str | Path) -> dict[str, str]:
    """``{table: sha256}`` of the results files the run's report.html was drawn from ({} without a report)."""
    import re

    f = Path(run_dir, "report.html")
    text = f.read_text(encoding="utf-8") if f.is_file() else ""
    return dict(re.findall(r"data-table='([^']*)' data-sha256='([0-9a-f]{64})'", text))


def write_report(run_dir: str | Path) -> Path:
    from vitscope.analyses import ANALYSES

    run_dir = Path(run_dir)
    mf = run_dir / "manifest.json"
    manifest = json.loads(mf.read_text()) if mf.is_file() else {}
    results = sorted((run_dir / "results").glob("*.parquet"))
    order = {name: i for i, name in enumerate(ANALYSES)}
    results.sort(key=lambda p: order.get(p.stem, len(order)))
    models = manifest.get("models", {})
    ds = manifest.get("dataset", {})
    parts = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>vitscope report: "
             f"{_esc(run_dir.name)}</title><style>{_CSS}</style></head><body>",
             f"<h1>vitscope report: {_esc(run_dir.name)}</h1>",
             f"<p>{len(models)} model(s) on <b>{_esc(ds.get('name', '?'))}</b> ({ds.get('n_images', '?')} images); "
             f"{len(results)} analyses; {manifest.get('seconds', '?')} s; "
             f"vitscope {_esc(manifest.get('versions', {}).get('vitscope', '?'))}, "
             f"torch {_esc(manifest.get('versions', {}).get('torch', '?'))}, "
             f"timm {_esc(manifest.get('versions', {}).get('timm', '?'))}.</p>",
             "<nav>" + "".join(f"<a href='#{p.stem}'>{_esc(p.stem)}</a>" for p in results) + "</nav>"]
    if models:
        parts.append("<h2>Models</h2><table><tr><th>model</th><th>source</th><th>blocks</th><th>heads</th>"
                     "<th>grid</th><th>patch</th><th>weights</th><th>from cache</th></tr>")
        for label, m in models.items():
            parts.append(f"<tr><td>{_esc(label)}</td><td><code>{_esc(m.get('source'))}</code></td>"
                         f"<td>{_esc(m.get('depth', ''))}</td><td>{_esc(m.get('heads', ''))}</td>"
                         f"<td>{_esc(m.get('grid', ''))}</td><td>{_esc(m.get('patch', ''))}</td>"
                         f"<td>{_esc(m.get('load_report', ''))}</td>"
                         f"<td>{_esc(', '.join(m.get('analyses_from_cache', [])) or '-')}</td></tr>")
        parts.append("</table>")
    parts += _dense_summary(run_dir, results, models)
    skipped = manifest.get("skipped_images") or {}
    if isinstance(skipped, list):  # manifests written before datasets were named
        skipped = {"dataset": skipped}
    for name, items in skipped.items():
        parts.append(f"<p class='muted'>{len(items)} unreadable images of {_esc(name)} were skipped (see "
                     "manifest.json).</p>")
    for path in results:
        name = path.stem
        raw = path.read_bytes()  # drawn from exactly these bytes; their digest is in the report (results_digest)
        df = pd.read_parquet(io.BytesIO(raw))
        cls = ANALYSES.get(name)
        doc = (cls.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ").replace("``", "") if cls else ""
        parts.append(f"<h2 id='{_esc(name)}'>{_esc(name)}</h2><p>{_esc(doc)}</p>")
        own = getattr(cls, "key_numbers", None)  # an analysis may say which numbers matter (else the generic table)
        parts.append(_table(own(df) if callable(own) else key_numbers(df)))
        for title, fig in FIGURES.get(name, lambda d: [])(df):
            parts.append(f"<figure><img alt='{_esc(title)}' src='data:image/png;base64,{_png(fig)}'>"
                         f"<figcaption>{_esc(title)}</figcaption></figure>")
        parts.append(f"<p class='muted' data-table='{_esc(name)}' data-sha256='{hashlib.sha256(raw).hexdigest()}'>"
                     f"All {len(df)} rows: <code>pandas.read_parquet('results/{_esc(path.name)}')</code>.</p>")
    parts.append("</body></html>")
    out = run_dir / "report.html"
    write_atomic(out, lambda f: f.write("\n".join(parts).encode("utf-8")))
    return out
