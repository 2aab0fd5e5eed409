"""The self-contained HTML report of a run directory: a summary (key findings in sentences with their
uncertainty, flags on results within noise of chance or of the untrained model), models side by side, then per
analysis its description, key numbers and figures (PNG inline, with captions), and the references. Needs nothing
but the run directory: `vitscope report RUN_DIR` rebuilds it from the cached tables without touching any model
(`vitscope report RUN_DIR --export DIR` writes the figures as files for a paper, `vitscope.report.export`)."""

from __future__ import annotations

import base64
import hashlib
import html
import io
import logging
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from vitscope.files import write_atomic
from vitscope.references import REFERENCES, SHORT
from vitscope.report import interactive
from vitscope.report.run import BEST_LAYERS, Run, load_run
from vitscope.report.summary import Study, summarize
from vitscope.study.rundir import BEST_LAYERS_TABLE
from vitscope.threads import exit_with_parent, single_threaded

log = logging.getLogger(__name__)

_CSS = """body{font-family:system-ui,sans-serif;max-width:1150px;margin:2em auto;padding:0 1em;color:#222;
line-height:1.4}h1{font-size:1.6em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2.2em}
figure{display:inline-block;margin:.6em;vertical-align:top;max-width:100%}
figure img{max-width:100%}figcaption{font-size:.85em;color:#555;max-width:34em}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0;display:block;overflow-x:auto;max-width:100%}
td,th{border:1px solid #ddd;padding:.25em .5em;text-align:left}
th{background:#f6f6f6}code{background:#f4f4f4;padding:0 .2em}.muted{color:#777;font-size:.9em}
.caveat{border-left:3px solid #d98c00;padding-left:.6em}.empty{border-left:3px solid #d98c00;padding-left:.6em}
nav{display:flex;flex-wrap:wrap;gap:.3em 1em;max-width:100%}nav a{white-space:nowrap}
ul.summary li{margin:.3em 0}.flag{background:#fff3cd;color:#7a5b00;border-radius:3px;padding:0 .3em;
font-size:.85em;white-space:nowrap}ul.refs{font-size:.9em}"""


PALETTE_ABOVE = 150_000
"""A figure whose PNG is larger than this many bytes (the mosaics of maps) is embedded with a 256-colour palette
(median cut, no dithering: 2-3x smaller, no visible change; `--export` writes full colour): the page stays within
its size budget with the explorer's maps in it."""


def _png(fig: plt.Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    data = buf.getvalue()
    if len(data) > PALETTE_ABOVE:
        from PIL import Image

        image = Image.open(io.BytesIO(data)).convert("RGB")
        small = io.BytesIO()
        image.quantize(256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(small, format="png")
        data = min(data, small.getvalue(), key=len)
    return base64.b64encode(data).decode()


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


def _summary(run: Run) -> list[str]:
    """The summary section: key findings in sentences with their numbers; results within noise of chance or of
    the untrained model flagged."""
    from vitscope.zoo.findings import SEMANTIC_ANALYSES, budget_caveat

    points = summarize(run.tables, Study(run.models, run.untrained))
    if not points:
        return []
    caveat = budget_caveat(run.manifest.get("models", {}))
    parts = ["<h2 id='summary'>Summary</h2><ul class='summary'>"]
    for p in points:
        flag = "".join(f" <span class='flag'>within noise of {_esc(f)}</span>" for f in p.flags)
        mark = " † (MIM semantics: see the budget caveat)" if caveat and p.analysis in SEMANTIC_ANALYSES else ""
        parts.append(f"<li{' class=flagged' if p.flags else ''}><a href='#{_esc(p.analysis)}'>{_esc(p.analysis)}</a>: "
                     f"{_esc(p.text)}{mark}{flag}</li>")
    below = [f"{p.analysis} ({', '.join(p.not_above_chance)})" for p in points if p.not_above_chance]
    if below:
        parts.append(f"<li class=flagged><b>Not above chance</b> (within noise of chance, or below it): "
                     f"{_esc('; '.join(below))}.</li>")
    parts.append("</ul><p class='muted'>± and brackets: 95 % intervals over the images (standard errors in the "
                 "tables' <code>stderr</code> column; accuracies binomial, Wilson). Within noise: the difference is "
                 "at most 1.96 standard errors; a best layer is within noise of chance when its interval, "
                 "simultaneous over the layers it was chosen from, reaches chance (docs/CALIBRATION.md).</p>")
    parts += _findings(run)
    return parts


def _published(run: Run) -> list[str]:
    """The recipe's published numbers beside this run's (`vitscope.report.published`): paper X, this run Y ± e
    (half its 95 % interval), a missing row said so; references, not tests."""
    from vitscope.report.published import published_table

    table = published_table(run.tables, run.manifest)
    if table.empty:
        return []
    return ["<h2 id='published'>Published numbers</h2><p>The papers' numbers (the config's <code>published:</code>) "
            "beside this run's, ± half its 95 % interval, in the paper's units. A reference, not a test: the "
            "recipes' comments say where the protocol departs from the paper's.</p>", _table(table)]


def _findings(run: Run) -> list[str]:
    """The sources' contrastive-vs-MIM findings with their verdicts, when the study has both families: one sentence
    counting the verdicts, the budget caveat of the zoo's MIM models where they are in the study, and the table."""
    models = run.manifest.get("models", {})
    families = {meta.get("objective_family") for meta in models.values()}
    if not {"contrastive", "reconstructive"} <= families:
        return []
    from vitscope.zoo.findings import budget_caveat, check

    table = check(run.path)
    if table.empty:
        return []
    counts = table["verdict"].value_counts()
    words = {"holds": "hold", "contradicted": "contradicted", "inconclusive": "inconclusive",
             "no uncertainty": "without uncertainty"}
    said = ", ".join(f"{int(counts[w])} {'holds' if w == 'holds' and counts[w] == 1 else words[w]}"
                     for w in words if w in counts)
    rows = ["<h3>Contrastive vs reconstructive (the sources' findings)</h3>",
            f"<p>Of the sources' {len(table)} findings comparing contrastive with masked-image-modelling (MIM) "
            f"models, in this study: {_esc(said)}.</p>"]
    caveat = budget_caveat(models)
    if caveat:
        rows.append(f"<p class='caveat'>{_esc(caveat)}</p>")
    rows.append("<table><tr><th>finding</th><th>measure</th><th>contrastive</th><th>MIM</th><th>untrained</th>"
                "<th>CL - MIM (95 % interval)</th><th>verdict</th><th>why</th></tr>")
    for r in table.itertuples():
        iv = "" if pd.isna(r.difference_lo) else f" ({r.difference_lo:+.3g} to {r.difference_hi:+.3g})"
        mark = " †" if r.semantic else ""
        within = getattr(r, "within_mim", float("nan"))
        mim = f"{r.mim:.4g}" + ("" if pd.isna(within) else f" (MIM~MIM {within:.4g})")
        base = "-" if pd.isna(r.untrained) else f"{r.untrained:.4g}"
        rows.append(f"<tr><td>{_esc(r.finding)}{mark} {_esc(r.source)}</td><td>{_esc(r.measure)} "
                    f"({_esc(r.expected)})</td><td>{r.contrastive:.4g}</td><td>{_esc(mim)}</td><td>{base}</td>"
                    f"<td>{r.difference:+.3g}{iv}</td><td>{_esc(r.verdict)}</td><td>{_esc(r.reason)}</td></tr>")
    rows.append("</table><p class='muted'>A finding holds only when the 95 % interval of the difference excludes 0 "
                "and the group it is about has moved away from the untrained network in the claimed direction "
                "beyond its interval (<code>vitscope.zoo.findings</code> says how); inconclusive otherwise, with "
                "the reason. †: rests on MIM semantics (k-NN, probes, retrieval).</p>")
    return rows


def _dense_summary(run: Run, drawn: list[tuple[str, str]]) -> list[str]:
    """The best-layer summary of the dense downstream tasks: written to results/summary/best_layers.parquet
    (derived from the tasks' tables, rebuilt with the report; in a subfolder, so the study's check that results/
    holds exactly its analyses' tables is unaffected) and shown as a table and a task x model heat table
    (``drawn``: its (caption, PNG))."""
    summary = run.best_layers()
    if summary.empty:
        return []
    run_dir = run.path
    (run_dir / "results" / "summary").mkdir(parents=True, exist_ok=True)
    summary.to_parquet(run_dir / "results" / BEST_LAYERS_TABLE, index=False)
    extra = ["random_features_score"] if "random_features_score" in summary.columns else []
    shown = summary[["label", "model", "supervision", "best", "token_view", "score", "last_layer_score",
                     "random_init_score", "untrained_score", "chance", *extra, "protocol"]].rename(
        columns={"label": "task", "best": "best layer"})
    trained = summary[~summary.untrained]
    lead = ("<p><strong>Nothing here is above chance:</strong> no trained model's best layer clears its task's chance "
            "level beyond its 95 % interval (simultaneous over the layers), so the table ranks no layer.</p>"
            if len(trained) and not trained["above_chance"].any() else
            "<p><strong>Nothing here is above the untrained model:</strong> no trained model's best layer clears the "
            "untrained model's best beyond its 95 % interval, so the table ranks no layer.</p>"
            if len(trained) and not trained["finding"].any() else "")
    out = ["<h2 id='best_layers'>Dense downstream tasks: best layer</h2>", *([lead] if lead else []),
           "<p>Which block of which model is best for local tasks with no training (after Walmer et al., "
           "&ldquo;Teaching Matters: Investigating the Role of Supervision in Vision Transformers&rdquo;, CVPR "
           "2023, Table 1), beside the last block, a random-init model of the same architecture in this study "
           "and the task's chance level (\"no layer above chance\": the low end of the best score's 95 % interval, "
           "simultaneous over the layers and clustered by video or image pair, reaches it; \"not above the untrained "
           "model\": it reaches <code>untrained_score</code>, the untrained model's best); <code>protocol</code> "
           "says how the images "
           "reached the model (whole frame or centre crop, the model input's size, where propagation was scored). "
           "A best layer equal to the model's depth is the last block after the final norm. Table: "
           "<code>results/summary/best_layers.parquet</code>.</p>", *_variant_note(summary), _table(shown)]
    for title, png in drawn:
        out.append(f"<figure><img alt='{_esc(title)}' src='data:image/png;base64,{png}'>"
                   f"<figcaption>{_esc(title)}</figcaption></figure>")
    return out


def _variant_note(summary: pd.DataFrame) -> list[str]:
    """A note line naming the source's variants that ran (pixel matching, the Gaussian "random" baseline, SPair's
    letterbox and pair selection: the tables' ``variant``, shown in ``protocol``) and k-NN's rows, if any."""
    notes = []
    if "protocol" in summary.columns:
        ran = sorted({p.split("variant: ", 1)[1] for p in summary.protocol.dropna() if "variant: " in p})
        if ran:
            notes.append("Variants of Walmer et al.'s protocol that ran: " + "; ".join(_esc(v) for v in ran)
                         + (" (<code>random_features_score</code>: the same task on per-image Gaussian features)."
                            if "random_features_score" in summary.columns else "."))
    if "task" in summary.columns and (summary.task == "knn").any():
        notes.append("k-NN rows: the semantics table's k-NN top-1 accuracy, best over layers and image-level "
                     "views; chance = the majority-class rate, <code>random_features_score</code> = k-NN of "
                     "Gaussian features.")
    return [f"<p>{' '.join(notes)}</p>"] if notes else []


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


def _draw(run: Run, name: str) -> list[tuple[str, str]]:
    """(caption, base64 PNG) of every figure of one analysis."""
    return [(title, _png(fig)) for title, fig in run.figures(name)]


_FORKED_RUN: Run | None = None  # the run a forked drawing process inherits


def _drawing_process() -> None:
    """A drawing process dies with the study (`vitscope.threads.exit_with_parent`) and leaves Ctrl-C to it: it
    ignores SIGINT and finishes the figure in hand while the study stops the pool. Dying at once would break the
    pool, whose manager thread then prints a traceback beside the study's one line (CPython 3.11 sets an
    exception on the futures that ``map`` had just cancelled)."""
    import signal

    exit_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _draw_forked(name: str) -> list[tuple[str, str]]:
    assert _FORKED_RUN is not None
    return _draw(_FORKED_RUN, name)


def report_workers() -> int:
    """Processes that draw the report's figures: `vitscope.threads.workers` (2 where there are 2 cores; drawing
    is single-threaded), where processes can be forked (a forked process inherits the loaded run and every
    module, so it starts at once), else 1. ``VITSCOPE_WORKERS=1`` draws in this process."""
    import multiprocessing as mp

    from vitscope.threads import workers

    return workers() if "fork" in mp.get_all_start_methods() else 1


def _draw_all(run: Run, names: list[str]) -> dict[str, list[tuple[str, str]]]:
    """Every analysis's figures, drawn in `report_workers` processes (the same bytes as drawing them here)."""
    global _FORKED_RUN
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    workers = min(report_workers(), len(names))
    if workers < 2:
        return {n: _draw(run, n) for n in names}
    _FORKED_RUN = run
    # the largest tables first (their figures take longest): no process is left drawing a big one alone at the end
    order = sorted(names, key=lambda n: -len(run.tables.get(n, ())))
    before = set(mp.active_children())  # a study's helper is not ours to stop
    pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("fork"), initializer=_drawing_process)
    try:
        futures = [pool.submit(_draw_forked, n) for n in order]  # not `map`: it cancels futures when interrupted
        drawn = dict(zip(order, (f.result() for f in futures), strict=True))
        pool.shutdown()
        return {n: drawn[n] for n in names}
    except BrokenProcessPool:  # a drawing process was killed (e.g. out of memory): draw here instead
        log.warning("a process drawing the report's figures ended abruptly; drawing them in this process")
        pool.shutdown(wait=False)
        return {n: _draw(run, n) for n in names}
    except BaseException:  # Ctrl-C: the drawing processes stop now, not after the figures in hand
        for p in set(mp.active_children()) - before:
            p.kill()
        pool.shutdown(wait=False)
        raise
    finally:
        _FORKED_RUN = None


def _redraw(name: str, n_figures: int) -> str:
    """How to redraw this section's figures in Python: `vs.plot` gives one Figure, so where an analysis draws
    several the call names one (``figure=``, a position or a piece of the caption)."""
    if n_figures <= 1:
        return f"redraw the figure with <code>vitscope.plot(run_dir, '{_esc(name)}')</code>"
    return (f"redraw one of its {n_figures} figures with "
            f"<code>vitscope.plot(run_dir, '{_esc(name)}', figure=i)</code> (i from 0 to {n_figures - 1}, or a piece "
            "of its caption)")


def _empty_lines(empty: list[tuple[str, str]]) -> list[str]:
    """One line per model (or pair, or the cross-model stage) the analysis has no rows for, with the reason the
    study recorded (results/summary/empty.parquet): a missing model in a table is never silent."""
    return [f"<p class='empty'>no rows for {_esc(model)}: {_esc(reason)}</p>" for model, reason in empty]


_EXPLORER_TEXT = (
    "<p>Where every head of every model looks, for the kept images and any query token: hover a patch of an "
    "image (click to pin it), choose the block with the slider and a head or the mean of the heads; the query "
    "can also be the CLS token, a register or an attention pool's query. Beside each map: the rollout of the "
    "same query up to the block (heads averaged, Abnar and Zuidema 2020), and the head's type from "
    "<code>aligned_attention_maps</code> where the study ran it. Colour: each map scaled to its own maximum (said "
    "under it). The maps are the study's own attention taps, every row stored as 8-bit codes of its maximum "
    "(error at most 1/510 of the row's maximum).</p><div id='vs-explorer' class='vs-js'></div><noscript><p "
    "class='empty'>The explorer needs scripts; below, the centre and corner patches' maps of its first "
    "image.</p></noscript>")


def _page_data(run: Run) -> dict:
    """What the page's scripts read (`vitscope.report.interactive`): the models (colours as in the figures), the
    charts per analysis and the explorer's maps."""
    from matplotlib.colors import to_hex

    from vitscope.report.figures._common import model_color

    models = run.models or sorted({str(m) for t in run.tables.values() if "model" in t for m in t["model"].dropna()})
    with run.figure_context():
        colors = {m: to_hex(model_color(m, models)) for m in models}
    return {"models": interactive.model_meta(models, run.untrained, run.families, colors),
            "charts": interactive.charts(run.tables, models), "explorer": interactive.explorer(run.tables, models)}


def write_report(run_dir: str | Path) -> Path:
    from vitscope.analyses import ANALYSES

    run = load_run(run_dir)
    run_dir = run.path
    manifest = run.manifest
    models = manifest.get("models", {})
    datasets = manifest.get("datasets") or ({"": manifest["dataset"]} if manifest.get("dataset") else {})
    data_text = ", ".join(f"<b>{_esc(d.get('format', d.get('name', name)))}</b> ({d.get('n_images', '?')} images)"
                          for name, d in datasets.items()) or "?"
    names = list(run.tables)
    nav = ["summary", "models", *run.sections(), "references"]
    page = _page_data(run)
    parts = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'>"
             f"<meta name='viewport' content='width=device-width, initial-scale=1'><title>vitscope report: "
             f"{_esc(run_dir.name)}</title><style>{_CSS}\n{interactive.asset('vendor/uPlot.min.css')}\n"
             f"{interactive.asset('assets/interactive.css')}</style></head><body>",
             f"<h1>vitscope report: {_esc(run_dir.name)}</h1>",
             f"<p>{len(models)} model(s) on {data_text}; "
             f"{len(names)} analyses; {manifest.get('seconds', '?')} s; "
             f"vitscope {_esc(manifest.get('versions', {}).get('vitscope', '?'))}, "
             f"torch {_esc(manifest.get('versions', {}).get('torch', '?'))}, "
             f"timm {_esc(manifest.get('versions', {}).get('timm', '?'))}.</p>",
             "<nav>" + "".join(f"<a href='#{_esc(n)}'>{_esc(n)}</a>" for n in nav) + "</nav>",
             "<div id='vs-models' class='vs-js'></div>"]
    parts += _summary(run)
    parts += _published(run)
    if models:
        parts.append("<h2 id='models'>Models</h2><table><tr><th>model</th><th>family</th><th>source</th>"
                     "<th>architecture</th><th>readout</th><th>blocks</th><th>heads</th><th>grid</th><th>patch</th>"
                     "<th>weights</th><th>from cache</th></tr>")
        families = run.families
        for label, m in models.items():
            prefix = m.get("prefix_tokens")
            arch = m.get("family", "")
            if arch and prefix is not None:  # timm class family, and its prefix tokens (CLS, registers)
                cls = m.get("cls_token")
                arch += f", {prefix} prefix token{'s' if prefix != 1 else ''}" + (
                    "" if cls is None or not prefix else " (CLS first)" if cls else " (registers, no CLS)")
            parts.append(f"<tr><td>{_esc(label)}</td><td>{_esc(families.get(label, ''))}</td>"
                         f"<td><code>{_esc(m.get('source'))}</code></td><td>{_esc(arch)}</td>"
                         f"<td>{_esc(m.get('readout', ''))}</td>"
                         f"<td>{_esc(m.get('depth', ''))}</td><td>{_esc(m.get('heads', ''))}</td>"
                         f"<td>{_esc(m.get('grid', ''))}</td><td>{_esc(m.get('patch', ''))}</td>"
                         f"<td>{_esc(m.get('load_report', ''))}</td>"
                         f"<td>{_esc(', '.join(m.get('analyses_from_cache', [])) or '-')}</td></tr>")
        parts.append("</table>")
    drawn = _draw_all(run, run.figure_names())
    parts += _dense_summary(run, drawn.get(BEST_LAYERS, []))
    skipped = manifest.get("skipped_images") or {}
    if isinstance(skipped, list):  # manifests written before datasets were named
        skipped = {"dataset": skipped}
    for name, items in skipped.items():
        parts.append(f"<p class='muted'>{len(items)} unreadable images of {_esc(name)} were skipped (see "
                     "manifest.json).</p>")
    for name in run.sections():
        cls = ANALYSES.get(name)
        doc = (cls.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ").replace("``", "") if cls else ""
        parts.append(f"<h2 id='{_esc(name)}'>{_esc(name)}</h2><p>{_esc(doc)}</p>")
        parts += _empty_lines(run.empty.get(name, []))
        if name not in run.tables:  # no rows for any model: its section says why, and nothing else
            continue
        df = run.tables[name]
        explorer = name == interactive.EXPLORER  # its section is the explorer (its table holds bytes, no numbers)
        if explorer:
            parts.append(_EXPLORER_TEXT if page["explorer"] else "")
        else:
            own = getattr(cls, "key_numbers", None)  # an analysis may say which numbers matter (else the generic)
            parts.append(_table(own(df) if callable(own) else key_numbers(df)))
        if page["charts"].get(name):
            parts.append(f"<div class='vs-charts vs-js' data-analysis='{_esc(name)}'></div>")
        for title, png in drawn[name]:
            figure = (f"<figure><img alt='{_esc(title)}' src='data:image/png;base64,{png}'>"
                      f"<figcaption>{_esc(title)}</figcaption></figure>")
            # a figure the page's explorer or an interactive chart shows the data of stays for readers with scripts off
            shown = (explorer and page["explorer"]) or (page["charts"].get(name) and interactive.replaced(name, title))
            parts.append(f"<noscript>{figure}</noscript>" if shown else figure)
        # drawn from exactly the bytes whose digest is here (results_digest)
        parts.append(f"<p class='muted' data-table='{_esc(name)}' data-sha256='{run.digests[name]}'>"
                     f"All {len(df)} rows: <code>pandas.read_parquet('results/{_esc(name)}.parquet')</code>; "
                     f"{_redraw(name, len(drawn[name]))}, or write them all for a "
                     "paper with <code>vitscope report RUN_DIR --export DIR --format pdf</code>.</p>")
    parts.append("<h2 id='references'>References</h2><ul class='refs'>"
                 + "".join(f"<li><b>{_esc(SHORT[k])}</b>: {_esc(v)}</li>" for k, v in REFERENCES.items()) + "</ul>")
    parts.append(f"<script type='application/json' id='vs-data'>{interactive.to_json(page)}</script>"
                 f"<script>{interactive.asset('vendor/uPlot.iife.min.js')}</script>"
                 f"<script>{interactive.asset('assets/interactive.js')}</script></body></html>")
    out = run_dir / "report.html"
    write_atomic(out, lambda f: f.write("\n".join(parts).encode("utf-8")))
    return out
