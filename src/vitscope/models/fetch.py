"""Fetching weights: URLs and Hugging Face hub files, failing in seconds when there is no network.

Without a network, the hub client retries each request with back-off (about a minute per model) and
``urllib`` may wait on a silent firewall for much longer. Before any download, `unreachable` opens one TCP
connection to the host (or to the proxy in between) with a short timeout; when that fails, or when
``HF_HUB_OFFLINE`` is set, only local copies are used and the error names the file to fetch by hand.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

PROBE_SECONDS = 3.0  # connection probe; DNS included (it runs in a thread joined with this timeout)
_PROBE_TTL = 60.0  # a probe's answer is reused this long, so a study of many models probes once
_probes: dict[tuple[str, int], tuple[float, str | None]] = {}
_FALSE = {"", "0", "false", "no", "off"}


def hub_endpoint() -> str:
    try:
        from huggingface_hub import constants

        return str(constants.ENDPOINT)
    except ImportError:  # pragma: no cover - huggingface_hub comes with timm
        return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def hub_offline() -> str | None:
    """Why the Hugging Face hub cannot be used (``HF_HUB_OFFLINE`` set, or no connection), None if it can."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() not in _FALSE:
            return f"{var} is set"
    return unreachable(hub_endpoint())


def unreachable(url: str, timeout: float | None = None) -> str | None:
    """None when a TCP connection to ``url``'s host (or to the proxy for it) opens within ``timeout``
    seconds (default `PROBE_SECONDS`), else the reason in a few words. Answers are cached for a minute."""
    timeout = PROBE_SECONDS if timeout is None else timeout
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        return None  # file:// and the like: nothing to probe
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        p = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port = p.hostname or host, p.port or 80
    key = (host, port)
    now = time.monotonic()
    if key in _probes and now - _probes[key][0] < _PROBE_TTL:
        return _probes[key][1]
    answer: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection(key, timeout=timeout).close()
            answer.append(None)
        except OSError as e:
            answer.append(f"cannot connect to {host}:{port}: {e.strerror or e}")

    t = threading.Thread(target=connect, daemon=True)
    t.start()
    t.join(timeout)
    reason = answer[0] if answer else f"no answer from {host}:{port} within {timeout:g} s"
    _probes[key] = (now, reason)
    return reason


def hub_url(repo_id: str, filename: str, revision: str | None = None) -> str:
    return f"{hub_endpoint()}/{repo_id}/resolve/{revision or 'main'}/{filename}"


def cached_hub_file(repo_id: str, filenames: list[str], revision: str | None = None) -> str | None:
    """The first of ``filenames`` already in the local hub cache, or None (no network used)."""
    from huggingface_hub import try_to_load_from_cache

    for f in filenames:
        path = try_to_load_from_cache(repo_id, f, revision=revision)
        if isinstance(path, str) and Path(path).is_file():
            return path
    return None


def timm_weights(timm_name: str) -> tuple[str | None, str | None, str]:
    """For a timm tag: (why timm could not download its weights now, or None; the local hub cache's copy or
    None; the URL to fetch them from by hand). The files are those timm asks the hub for, safetensors first."""
    import timm

    cfg = timm.get_pretrained_cfg(timm_name)
    repo_id, _, revision = (getattr(cfg, "hf_hub_id", None) or "").partition("@")
    if not repo_id:  # weights timm fetches from a URL of their own
        url = str(getattr(cfg, "url", "") or "")
        return unreachable(url), None, url
    named = getattr(cfg, "hf_hub_filename", None)
    files = ([named[:-4] + ".safetensors", named] if named and named.endswith(".bin") else [named] if named
             else ["model.safetensors", "pytorch_model.bin"])
    reason = hub_offline()
    cached = cached_hub_file(repo_id, files, revision or None) if reason else None
    return reason, cached, hub_url(repo_id, files[0], revision or None)
