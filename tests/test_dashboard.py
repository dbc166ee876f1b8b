"""End to end: the live page at /dashboard (issue 12, check 4) in headless Chromium.

A server with --api-key runs traffic while Chromium loads the page with the key in its
address (?key=, ?ask=): the page must show a non-zero throughput, stream a chat answer, and
render (a screenshot, not blank). Chromium is driven over the DevTools protocol on a pipe
(--remote-debugging-pipe) so that the test waits for what the page shows, in real time,
instead of betting on a virtual-time budget. Skipped where Debian's `chromium` is missing
(`make test` installs it where apt is available).
"""

from __future__ import annotations

import base64
import json
import math
import os
import select
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.server import serving, wait_idle, wait_until

pytestmark = pytest.mark.e2e

KEY = "dashboard-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
WAIT = 120.0            # seconds: guards against a hang only; nothing here assumes a speed


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    with serving(tiny_model("llama"), "--api-key", KEY,
                 tmpdir=tmp_path_factory.mktemp("dashboard")) as s:
        s.client.headers.update(AUTH)       # the helpers (wait_idle) read /server_info
        yield s


# ---- a DevTools client on a pipe --------------------------------------------------------------

PROBLEMS_PROBE = """
window.__problems = [];
document.addEventListener('securitypolicyviolation',
    (e) => window.__problems.push('CSP ' + e.violatedDirective + ' ' + e.blockedURI));
window.addEventListener('error', (e) => window.__problems.push('error ' + e.message));
window.addEventListener('unhandledrejection',
    (e) => window.__problems.push('rejection ' + e.reason));
"""

class Chromium:
    """Headless Chromium with --remote-debugging-pipe: JSON messages, each ended by a NUL
    byte, that Chromium reads on its fd 3 and writes on its fd 4. One page, one session."""

    def __init__(self, tmp: Path, width: int = 1200, height: int = 900):
        to_r, self.to_w = os.pipe()
        self.from_r, from_w = os.pipe()
        self.log = open(tmp / "chromium.log", "w")
        args = ["--headless=new", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
                f"--user-data-dir={tmp / 'profile'}", f"--window-size={width},{height}",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--mute-audio", "--hide-scrollbars", "--disable-dev-shm-usage",
                "about:blank"]
        # bash (dash takes no fd above 9) puts the pipe ends where Chromium looks for them,
        # then becomes Chromium.
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$0" "$@" 3<&{to_r} 4>&{from_w} {to_r}<&- {from_w}>&-',
             shutil.which("chromium"), *args],
            pass_fds=(to_r, from_w), stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "HOME": str(tmp)}, start_new_session=True)
        os.close(to_r)
        os.close(from_w)
        self.buffer = b""
        self.next_id = 0
        self.session = None
        try:
            self._open_page(width, height)
        except BaseException:
            self.close()
            raise

    def _open_page(self, width: int, height: int) -> None:
        target = self.send("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.send("Target.attachToTarget", targetId=target,
                                 flatten=True)["sessionId"]
        self.send("Emulation.setDeviceMetricsOverride", width=width, height=height,
                  deviceScaleFactor=1, mobile=False)
        # Every page records what its Content-Security-Policy blocked and its uncaught errors
        # (this script comes from DevTools: the policy does not apply to it).
        self.send("Page.enable")
        self.send("Page.addScriptToEvaluateOnNewDocument", source=PROBLEMS_PROBE)

    def send(self, method: str, timeout: float = WAIT, **params) -> dict:
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params}
        if self.session is not None:
            message["sessionId"] = self.session
        data = json.dumps(message).encode() + b"\0"
        while data:
            data = data[os.write(self.to_w, data):]
        deadline = time.monotonic() + timeout
        while True:
            reply = self._receive(deadline)
            if reply.get("id") == self.next_id:         # events and others are dropped
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]

    def _receive(self, deadline: float) -> dict:
        while b"\0" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.from_r], [], [], left)[0]:
                raise TimeoutError(f"no answer from Chromium:\n{self.logs()}")
            chunk = os.read(self.from_r, 1 << 20)
            if not chunk:
                raise ConnectionError(f"Chromium closed the pipe:\n{self.logs()}")
            self.buffer += chunk
        message, _, self.buffer = self.buffer.partition(b"\0")
        return json.loads(message)

    def navigate(self, url: str) -> None:
        self.send("Page.navigate", url=url)

    def js(self, expression: str):
        """The value of a JavaScript expression in the page (JSON-serializable)."""
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True,
                           awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, what: str, timeout: float = WAIT):
        """Until the expression is truthy in the page (it may not exist yet: a load)."""
        def check():
            try:
                return self.js(expression)
            except RuntimeError:
                return None
        return wait_until(check, timeout, what)

    def screenshot(self, path: Path) -> Path:
        path.write_bytes(base64.b64decode(self.send("Page.captureScreenshot",
                                                    format="png")["data"]))
        return path

    def logs(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-4000:]

    def close(self) -> None:
        try:
            self.session = None
            self.send("Browser.close", timeout=10)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)     # its own group: its helpers too
            self.proc.wait()
        os.close(self.to_w)
        os.close(self.from_r)
        self.log.close()


@pytest.fixture(scope="module")
def browser(server, tmp_path_factory):
    """Every test that needs it is skipped where Chromium is not installed."""
    if shutil.which("chromium") is None:
        pytest.skip("headless Chromium is not installed (Debian: apt-get install chromium; "
                    "`make test` does so where apt is available)")
    b = Chromium(tmp_path_factory.mktemp("chromium"))
    try:
        yield b
    finally:
        b.close()


@pytest.fixture
def traffic(server):
    """Unary /generate requests back to back (two at a time) while the test runs, so that
    tokens flow inside the page's throughput window whenever it looks."""
    stop, failures = threading.Event(), []

    def loop():
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=WAIT) as c:
            while not stop.is_set():
                r = c.post("/generate", json={"text": "The dashboard", "sampling_params": {
                    "max_new_tokens": 24, "ignore_eos": True, "temperature": 0}})
                if r.status_code != 200:
                    failures.append(r.text)
                    return
    threads = [threading.Thread(target=loop, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    yield
    stop.set()
    for t in threads:
        t.join(WAIT)
    assert not failures, failures
    wait_idle(server)


# ---- the route --------------------------------------------------------------------------------

def test_the_page_is_public_and_self_contained_the_data_is_not(server):
    with httpx.Client(base_url=server.url, timeout=WAIT) as anonymous:
        page = anonymous.get("/dashboard")
        assert anonymous.get("/server_info").status_code == 401
        assert anonymous.get("/v1/chat/completions").status_code == 401
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert page.headers["cache-control"] == "no-store"
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert "unsafe" not in csp and "script-src 'sha256-" in csp
    # No build step, no CDN: nothing is loaded from elsewhere.
    assert "http://" not in page.text and "https://" not in page.text
    assert "src=" not in page.text and "<link rel=\"stylesheet\"" not in page.text
    assert server.client.get("/server_info").status_code == 200     # with the key


# ---- the page in Chromium ---------------------------------------------------------------------

FIGURE = "document.getElementById({!r}).dataset.value"


def test_the_page_shows_traffic_and_streams_a_chat_answer(server, browser, traffic, tmp_path):
    before = server.server_info()["generated_tokens_total"]
    wait_until(lambda: server.server_info()["generated_tokens_total"] > before,
               WAIT, "the traffic to generate tokens")
    browser.navigate(f"{server.url}/dashboard?key={KEY}&ask=Hello")
    browser.wait_for("document.getElementById('chat-answer')?.dataset.chatDone === '1' || "
                     "document.getElementById('chat-answer')?.dataset.chatError",
                     "the chat answer to finish")
    state = browser.js("""(() => { const a = document.getElementById('chat-answer');
        return {done: a.dataset.chatDone, error: a.dataset.chatError || null,
                answer: a.textContent,
                status: document.getElementById('chat-status').textContent}; })()""")
    assert state["done"] == "1" and state["error"] is None, state
    assert state["answer"].strip(), state          # the deltas were rendered
    # The key from the address reached every call, and it left the address bar.
    assert browser.js("location.search") == ""
    assert browser.js("document.getElementById('status').dataset.state") == "ok"
    # Throughput: tokens flowed between two polls of /server_info.
    throughput = float(browser.wait_for(
        f"Number({FIGURE.format('throughput')}) > 0 && {FIGURE.format('throughput')}",
        "a non-zero throughput on the page"))
    assert throughput > 0
    assert int(browser.js(FIGURE.format("generated-total"))) > before
    assert int(browser.js(FIGURE.format("kv-total"))) == server.server_info()["kv_pool"]["total"]
    assert browser.js("document.getElementById('model').textContent") == \
        server.server_info()["served_model_name"]
    if server.client.get("/metrics").status_code == 200:
        # A second sample of the histograms after traffic: the last minute's TTFT shows.
        ttft = browser.wait_for(f"{FIGURE.format('ttft-p50')}", "a TTFT percentile")
        assert float(ttft) > 0
        assert browser.js("document.getElementById('ttft-p50').textContent").endswith("s")
        # finished requests per route: the traffic's, and the chat box's once it finished
        by_route = browser.wait_for("document.getElementById('by-route').textContent"
                                    ".includes('chat_completions') && document"
                                    ".getElementById('by-route').textContent",
                                    "the requests counted by route")
        assert by_route.startswith("by route: "), by_route
    else:                                          # no /metrics: "-" and the page goes on
        assert browser.js("document.getElementById('ttft-p50').textContent") == "-"

    assert browser.js("window.__problems") == []
    shot = browser.screenshot(tmp_path / "dashboard.png")
    assert_not_blank(shot, 1200, 900)


def assert_not_blank(png: Path, width: int, height: int) -> None:
    from matplotlib.image import imread
    pixels = imread(png)                     # height x width x channels, floats in 0..1
    assert pixels.shape[:2] == (height, width), pixels.shape
    rgb = (pixels[..., :3] * 255).round().astype(np.uint8).reshape(-1, 3)
    colours = np.unique(rgb, axis=0)
    assert len(colours) > 50, f"{png}: {len(colours)} colours, the page looks blank"
    background = np.bincount(np.ravel_multi_index(rgb.T, (256, 256, 256))).max()
    assert background < 0.95 * len(rgb), f"{png}: one colour covers almost every pixel"


def test_without_a_key_the_page_says_401_then_takes_one(server, browser):
    browser.navigate(f"{server.url}/dashboard")
    browser.js("sessionStorage.clear()")
    browser.navigate(f"{server.url}/dashboard")
    text = browser.wait_for("document.getElementById('status').dataset.state === "
                            "'unauthorized' && document.getElementById('status').textContent",
                            "the 401 error line")
    assert "401" in text and "API key" in text
    assert browser.js(FIGURE.format("throughput")) == ""
    assert browser.js("document.getElementById('throughput').textContent") == "-"
    browser.js(f"""document.getElementById('key').value = {json.dumps(KEY)};
                   document.getElementById('key-form').requestSubmit(); true""")
    browser.wait_for("document.getElementById('status').dataset.state === 'ok'",
                     "the page to work with the typed key")
    assert browser.js("sessionStorage.getItem('zserve.dashboard.key')") == KEY
    assert browser.js(FIGURE.format("generated-total")) != ""


NO_METRICS = """
const fetchFromServer = window.fetch;
window.fetch = (url, init) => String(url).startsWith('/metrics')
    ? Promise.resolve(new Response('{"error": {"message": "Not Found"}}', {status: 404}))
    : fetchFromServer(url, init);
"""


def test_without_metrics_the_page_shows_dashes_and_goes_on(server, browser):
    """A server without /metrics (404): the figures that come from it read "-"."""
    probe = browser.send("Page.addScriptToEvaluateOnNewDocument", source=NO_METRICS)
    try:
        browser.navigate(f"{server.url}/dashboard?key={KEY}")
        browser.wait_for("document.getElementById('hit-rate-note').textContent === "
                         "'this server has no /metrics'", "the page to see no /metrics")
        browser.wait_for(f"{FIGURE.format('throughput')} !== ''", "a second /server_info")
    finally:
        browser.send("Page.removeScriptToEvaluateOnNewDocument",
                     identifier=probe["identifier"])
    for figure in ("hit-rate", "ttft-p50", "itl-p99", "e2e-p90"):
        assert browser.js(f"document.getElementById({figure!r}).textContent") == "-"
        assert browser.js(FIGURE.format(figure)) == ""
    assert browser.js("document.getElementById('status').dataset.state") == "ok"
    assert browser.js(FIGURE.format("generated-total")) != ""


# ---- the page's arithmetic, in the browser ----------------------------------------------------

EXPOSITION = """\
# HELP zserve:time_to_first_token_seconds Time to first token.
# TYPE zserve:time_to_first_token_seconds histogram
zserve:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 10.0
zserve:time_to_first_token_seconds_bucket{le="0.5",model_name="m"} 60.0
zserve:time_to_first_token_seconds_bucket{le="1.0",model_name="m"} 90.0
zserve:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 100.0
zserve:time_to_first_token_seconds_count{model_name="m"} 100.0
zserve:time_to_first_token_seconds_sum{model_name="m"} 42.5
# TYPE zserve:num_running_reqs gauge
zserve:num_running_reqs{dp_rank="0",model_name="m"} 3.0
zserve:num_running_reqs{dp_rank="1",model_name="m"} 4.0
zserve:prefix_cache_hit_rate{dp_rank="0"} 0.25
zserve:prefix_cache_hit_rate{dp_rank="1"} 0.75
weird_label{path="a\\"}b"} 1e3
"""


def python_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile, the reference the page's must match."""
    rank, lower, below = q * buckets[-1][1], 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            return lower if math.isinf(le) else lower + (le - lower) * (rank - below) / (
                count - below)
        lower, below = le, count
    return lower


def test_quantiles_and_gauges_from_the_prometheus_text(server, browser):
    browser.navigate(f"{server.url}/dashboard?key={KEY}")
    browser.wait_for("window.zserveDashboard", "the page's script")
    got = browser.js(f"""(() => {{
        const d = window.zserveDashboard, s = d.parsePrometheus({json.dumps(EXPOSITION)});
        const h = d.histogram(s, 'zserve:time_to_first_token_seconds');
        const before = {{buckets: [[0.1, 5], [0.5, 5], [1.0, 5], [Infinity, 5]],
                         count: 5, sum: 1}};
        const delta = d.histogramDelta(h, before);
        return {{
          buckets: h.buckets.map(([le, c]) => [String(le), c]), count: h.count,
          q: [0.05, 0.5, 0.9, 0.95, 0.99].map((q) => d.histogramQuantile(q, h.buckets)),
          dq: [0.5, 0.99].map((q) => d.histogramQuantile(q, delta.buckets)),
          reset: d.histogramDelta(before, h),
          running: d.gauge(s, 'zserve:num_running_reqs'),
          hit: d.gauge(s, 'zserve:prefix_cache_hit_rate', 'mean'),
          absent: d.gauge(s, 'zserve:kv_pool_usage'),
          empty: d.histogramQuantile(0.5, [[0.1, 0], [Infinity, 0]]),
          weird: s.find((x) => x.name === 'weird_label'),
        }}; }})()""")
    buckets = [(0.1, 10.0), (0.5, 60.0), (1.0, 90.0), (math.inf, 100.0)]
    assert got["buckets"] == [["0.1", 10], ["0.5", 60], ["1", 90], ["Infinity", 100]]
    assert got["count"] == 100
    assert got["q"] == pytest.approx([python_quantile(q, buckets)
                                      for q in (0.05, 0.5, 0.9, 0.95, 0.99)])
    assert got["q"] == pytest.approx([0.05, 0.42, 1.0, 1.0, 1.0])
    delta = [(le, c - 5) for le, c in buckets]           # what came after the earlier snapshot
    assert got["dq"] == pytest.approx([python_quantile(q, delta) for q in (0.5, 0.99)])
    assert got["reset"] is None                        # counters went back: no delta
    assert got["running"] == 7 and got["hit"] == pytest.approx(0.5)
    assert got["absent"] is None and got["empty"] is None
    assert got["weird"] == {"name": "weird_label", "labels": {"path": 'a"}b'}, "value": 1000}


def test_the_policy_is_in_force(server, browser):
    """What the page may not do is refused (and seen by the probe the traffic test reads)."""
    browser.navigate(f"{server.url}/dashboard?key={KEY}")
    browser.wait_for("window.zserveDashboard", "the page's script")
    browser.js("""document.body.setAttribute('style', 'outline: 1px solid red');
                  fetch('http://example.invalid/x').catch(() => {}); true""")
    problems = browser.wait_for("window.__problems.length >= 2 && window.__problems",
                                "the violations to be reported")
    assert any(p.startswith("CSP style-src-attr") for p in problems), problems
    assert any(p.startswith("CSP connect-src http://example.invalid") for p in problems), \
        problems
