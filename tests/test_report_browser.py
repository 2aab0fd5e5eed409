"""The report renders in a real headless browser: no console errors, every figure decodes, and at 1000 px the
navigation wraps onto more lines instead of running off the page."""

import shutil

import pytest
from test_study_cli import TINY_YAML

from vitscope.study import load_config, run_study

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
DRIVER = shutil.which("chromedriver")


@pytest.mark.skipif(CHROMIUM is None or DRIVER is None, reason="chromium and chromedriver are not installed")
def test_report_renders_without_console_errors_and_images_decode(tmp_path):
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    cfg = tmp_path / "study.yaml"
    cfg.write_text(TINY_YAML)
    more = ["analyses.diversity={batch_size: 6}", "analyses.residual_cka={batch_size: 6}", "analyses.attention_nmi={}",
            "analyses.aligned_attention_maps={}", "analyses.cls_attention_maps={keep_images: 1}",
            "analyses.svd_volume={}", "analyses.fourier={}"]  # enough sections that the navigation must wrap
    out = run_study(load_config(cfg, [f"output_dir={tmp_path / 'run'}", *more]))
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                 f"--user-data-dir={tmp_path / 'profile'}"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=opts)
    try:
        driver.set_window_size(1000, 900)
        driver.get((out / "report.html").resolve().as_uri())
        images = driver.execute_script(
            "return Array.from(document.images).map(i => [i.complete, i.naturalWidth, i.naturalHeight, i.alt]);")
        errors = [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]
        title = driver.title
        nav = driver.execute_script(
            "const n = document.querySelector('nav'); const links = Array.from(n.querySelectorAll('a'));"
            "return {width: n.clientWidth, scroll: n.scrollWidth, page: document.documentElement.clientWidth,"
            " pageScroll: document.documentElement.scrollWidth, window: window.innerWidth,"
            " rows: new Set(links.map(a => a.offsetTop)).size,"
            " linksWidth: links.reduce((s, a) => s + a.offsetWidth, 0),"
            " right: Math.max(...links.map(a => a.getBoundingClientRect().right))};")
    finally:
        driver.quit()
    assert title.startswith("vitscope report")
    assert len(images) >= 4
    undecoded = [alt for complete, w, h, alt in images if not (complete and w > 0 and h > 0)]
    assert undecoded == []
    assert errors == []
    assert nav["window"] <= 1000
    assert nav["linksWidth"] > nav["width"]  # the links do not fit on one line at this width ...
    assert nav["rows"] >= 2  # ... so they wrap
    assert nav["scroll"] <= nav["width"] and nav["right"] <= nav["page"]  # nothing runs off the page
    assert nav["pageScroll"] <= nav["page"]  # and the page has no horizontal scroll
