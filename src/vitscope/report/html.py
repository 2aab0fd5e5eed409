"""The self-contained HTML report of a run directory: every figure inline (PNG, base64), key numbers."""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from vitscope.report.figures import FIGURES

_CSS = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.6em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2em}
figure{display:inline-block;margin:.5em;vertical-align:top}figcaption{font-size:.85em;color:#555}
table{border-collapse:collapse;font-size:.85em}td,th{border:1px solid #ddd;padding:.25em .5em;text-align:left}
code{background:#f4f4f4;padding:0 .2em}"""


def _png(fig: plt.Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def write_report(run_dir: str | Path) -> Path:
    run_dir = Path(run_dir)
    manifest = json.loads((run_dir / "manifest.json").read_text()) if (run_dir / "manifest.json").is_file() else {}
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>vitscope report</title>"
             f"<style>{_CSS}</style></head><body><h1>vitscope report: {html.escape(run_dir.name)}</h1>"]
    models = manifest.get("models", {})
    if models:
        parts.append("<h2>Models</h2><table><tr><th>model</th><th>source</th><th>blocks</th><th>heads</th>"
                     "<th>grid</th><th>patch</th><th>weights</th></tr>")
        for label, m in models.items():
            parts.append(f"<tr><td>{html.escape(label)}</td><td><code>{html.escape(str(m['source']))}</code></td>"
                         f"<td>{m['depth']}</td><td>{m['heads']}</td><td>{m['grid']}</td><td>{m['patch']}</td>"
                         f"<td>{html.escape(m['load_report'])}</td></tr>")
        parts.append("</table>")
        ds = manifest.get("dataset", {})
        parts.append(f"<p>Dataset: <b>{html.escape(str(ds.get('name')))}</b>, {ds.get('n_images')} images.</p>")
    for path in sorted((run_dir / "results").glob("*.parquet")):
        name = path.stem
        df = pd.read_parquet(path)
        parts.append(f"<h2>{html.escape(name)}</h2><p>{len(df)} rows in <code>results/{path.name}</code>.</p>")
        for title, fig in FIGURES.get(name, lambda d: [])(df):
            parts.append(f"<figure><img alt='{html.escape(title)}' src='data:image/png;base64,{_png(fig)}'>"
                         f"<figcaption>{html.escape(title)}</figcaption></figure>")
    parts.append("</body></html>")
    out = run_dir / "report.html"
    tmp = out.with_suffix(".html.tmp")
    tmp.write_text("\n".join(parts), encoding="utf-8")
    tmp.replace(out)
    return out
