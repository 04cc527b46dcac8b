"""What a warm restart adopted, as operators see it: the Prometheus families, ``hicached status``
and the status page's adoption line, from ``/stats``'s ``adoption`` (``daemon/metrics.py``,
``ops/status.py``, ``ops/status.html``). A daemon that reports no adoption started cold."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources

from admin_helpers import admin_daemon, http, sample, scrape
from browser import Dom, chromium, dump_dom
from conftest import wait_until
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from hicached.daemon.metrics import _Collector
from hicached.ops.adminctl import format_status
from hicached.ops.status import adoption_line

WARM = {"pages": 123456, "bytes": 123456 * 65536, "dropped": {"torn": 2, "uncommitted": 17},
        "seconds": 0.8123, "cold_reason": None, "kept_on_stop": False}
COLD = {"pages": 0, "bytes": 0, "dropped": {}, "seconds": 0.0,
        "cold_reason": "l2_size changed: the kept arena is 4 GiB, this one 8 GiB",
        "kept_on_stop": False}


def families(adoption) -> dict:
    out = {}
    for fam in _Collector._adoption(adoption, CounterMetricFamily, GaugeMetricFamily):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_prometheus_families_of_a_warm_a_cold_and_an_unreported_start():
    assert families(WARM) == {
        ("hicached_adopted_pages_total", ()): 123456,
        ("hicached_adopted_bytes_total", ()): 123456 * 65536,
        ("hicached_adoption_dropped_pages_total", (("reason", "torn"),)): 2,
        ("hicached_adoption_dropped_pages_total", (("reason", "uncommitted"),)): 17,
        ("hicached_adoption_seconds", ()): 0.8123,
        ("hicached_adoption_cold", ()): 0}
    zeros = {("hicached_adopted_pages_total", ()): 0, ("hicached_adopted_bytes_total", ()): 0,
             ("hicached_adoption_seconds", ()): 0.0, ("hicached_adoption_cold", ()): 1}
    assert families(COLD) == families(None) == zeros


def test_the_adoption_line():
    assert adoption_line(WARM) == ("warm start: adopted 123,456 pages (7.54 GiB) in 0.81 s; "
                                   "dropped 19 (2 torn, 17 uncommitted)")
    assert adoption_line({**WARM, "dropped": {}}).endswith("in 0.81 s; none dropped")
    assert adoption_line(COLD) == ("cold start: l2_size changed: the kept arena is 4 GiB, "
                                   "this one 8 GiB")
    assert adoption_line(None) == "cold start"


def test_a_real_daemons_metrics_stats_and_status_say_how_it_started(make_daemon):
    """Before and after the daemon reports adoption: a fresh daemon started cold."""
    d, url = admin_daemon(make_daemon, key="")
    samples = scrape(url)
    assert sample(samples, "hicached_adopted_pages_total") == 0
    assert sample(samples, "hicached_adopted_bytes_total") == 0
    assert sample(samples, "hicached_adoption_seconds") == 0
    assert sample(samples, "hicached_adoption_cold") == 1
    _, stats = http("GET", url + "/stats")
    a = stats["adoption"]
    assert a is None or (a["pages"], a["bytes"], a["cold_reason"] is not None) == (0, 0, True)
    out = format_status(url, {"status": "ok"}, {"ready": True}, stats)
    assert f"\n  start   {adoption_line(a)}\n" in out and "cold start" in out
    assert format_status(url, {"status": "ok"}, {"ready": True}, {**stats, "adoption": WARM}
                         ).split("\n")[1] == "  start   " + adoption_line(WARM)


class PageServer(ThreadingHTTPServer):
    """The status page and a ``status.json`` given to it, on loopback."""

    def __init__(self, view: dict):
        page = resources.files("hicached.ops").joinpath("status.html").read_bytes()
        body = json.dumps(view).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - the stdlib's name
                data, ctype = (page, "text/html") if self.path == "/" else (
                    body, "application/json")
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self):
        self.shutdown()
        self.server_close()
        self.thread.join(10)


def test_the_page_shows_the_adoption_line(make_daemon):
    """In a real browser: a real daemon's status.json, as it is (a cold start) and with the
    ``adoption`` of a warm one put in its stats."""
    chromium()  # skips here, saying why, without a browser
    _, url = admin_daemon(make_daemon, key="", extra=["--status-sample-s", "0.2"])
    assert wait_until(lambda: http("GET", url + "/status.json")[1]["stats"]), "no sample"
    _, view = http("GET", url + "/status.json")
    for adoption, cold in ((view["stats"].get("adoption"), "1"), (WARM, "0"), (COLD, "1")):
        server = PageServer({**view, "stats": {**view["stats"], "adoption": adoption}})
        try:
            page = dump_dom(server.url + "/")
        finally:
            server.close()
        line, a = Dom(page).by_id("adoption"), adoption or {}
        assert f">{adoption_line(adoption)}</p>" in page  # the words hicached status prints
        assert (line["data-pages"], line["data-bytes"], line["data-cold"]) == (
            str(a.get("pages", 0)), str(a.get("bytes", 0)), cold)
        assert line["data-dropped"] == str(sum((a.get("dropped") or {}).values()))
