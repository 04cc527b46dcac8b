"""Helpers of the operations tests: free ports, real HTTP calls (urllib), Prometheus parsing."""

import json
import socket
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

KEY = "s3cr3t-admin-key-for-tests"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def admin_daemon(make_daemon, key=KEY, extra=(), **kw):
    """A daemon with its admin API on a free port; returns (daemon, base url)."""
    port = free_port()
    args = ["--admin-port", str(port), *(["--admin-api-key", key] if key else []), *extra]
    return make_daemon(extra=args, **kw), f"http://127.0.0.1:{port}"


def http(method, url, body=None, key=None, headers=None):
    """(status, decoded JSON or text) of one real HTTP request."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            status, raw, ctype = resp.status, resp.read(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        status, raw, ctype = e.code, e.read(), e.headers.get("Content-Type", "")
        e.close()
    if "json" in ctype:
        return status, json.loads(raw)
    return status, raw.decode()


def scrape(url) -> dict:
    """``GET /metrics`` as {(sample name, frozenset(labels.items())): value}."""
    status, text = http("GET", url + "/metrics")
    assert status == 200
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def sample(samples: dict, name: str, **labels) -> float:
    return samples[(name, frozenset(labels.items()))]
