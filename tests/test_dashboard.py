"""The pool's web dashboard: its credentials (pure), its HTTP surface against a real pool (no
anonymous access, one-time links, read-only), and the page in a real browser (Debian's Chromium
driven by Playwright) against a real pool with dispatchers: GPU bars, a lease after
`rgpu-admin request-gpus`, live updates, and a screenshot."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rgpu import weblogin
from rgpu.errors import AuthError
from rgpu.model import GpuInfo, LeaseRecord, QuotaRecord, SliceRecord
from rgpu.remoting.pool.dashboard_data import dashboard_state
from rgpu.remoting.pool.events import Event
from rgpu.remoting.pool.views import GpuView, LeaseView, PoolView, ServerView
from tests.daemons import EXAMPLES, HoldingSession, RgpuCluster, wait_for, wait_for_port_file

SECRET = b"0123456789abcdef0123456789abcdef"
GIB = 1 << 30


# --- pure ------------------------------------------------------------------------------------------

def test_login_links_and_sessions_are_signed_and_expire() -> None:
    link = weblogin.login_link_token(SECRET, now=1000.0)
    assert weblogin.verify(SECRET, weblogin.LINK, link, now=1100.0).expires_unix == 1000 + weblogin.LINK_TTL_SECONDS
    with pytest.raises(AuthError, match="expired"):
        weblogin.verify(SECRET, weblogin.LINK, link, now=1000.0 + weblogin.LINK_TTL_SECONDS)
    with pytest.raises(AuthError, match="malformed"):                   # a link is no session
        weblogin.verify(SECRET, weblogin.SESSION, link, now=1100.0)
    with pytest.raises(AuthError, match="not signed with this pool's cluster secret"):
        weblogin.verify(b"another secret of enough length!", weblogin.LINK, link, now=1100.0)
    kind, expires, nonce, mac = link.split(".")
    with pytest.raises(AuthError, match="not signed"):                  # a later expiry, forged
        weblogin.verify(SECRET, weblogin.LINK, f"{kind}.{int(expires) + 9999}.{nonce}.{mac}", now=1100.0)


def test_dashboard_url_from_the_settings() -> None:
    from rgpu.config import load_settings

    settings = load_settings(env={"RGPU_POOL": "pool1:50001", "RGPU_DASHBOARD_LISTEN": "0.0.0.0:50080"})
    assert weblogin.dashboard_base_url(settings) == "http://pool1:50080"
    settings = load_settings(env={"RGPU_DASHBOARD_URL": "https://rgpu.example.org/", "RGPU_CONFIG": "/dev/null"})
    url = weblogin.login_url(settings, SECRET, now=time.time())
    assert url.startswith("https://rgpu.example.org/login?t=link1.")


def test_state_document_from_a_view() -> None:
    from rgpu.proto import rgpu_pb2 as pb
    from rgpu.remoting.pool.accounting import SliceUsageRecord

    gpu = GpuInfo("GPU-00000000-0000-0000-0000-000000000001", 0, "NVIDIA H100", 80 * GIB, 80 * GIB, "9.0")
    lease = LeaseRecord("job-7", "alice", "physics", 100.0, 0.0, (SliceRecord("h:1", gpu.uuid, 0, gpu.name, 40 * GIB, 50),))
    reading = pb.GpuTelemetry(gpu_uuid=gpu.uuid, source="nvml", utilization_percent=12.0, memory_used_bytes=3 * GIB,
                              temperature_celsius=41.0, power_watts=120.0, power_limit_watts=700.0, ecc_uncorrected=1)
    fault = pb.GpuFault(gpu_uuid=gpu.uuid, error="CUDA_ERROR_ILLEGAL_ADDRESS", unix=150.0, sessions_ended=2,
                        cross_tenant=True, faulting="job job-7 slice 0")
    view = PoolView(now=160.0, servers=(ServerView("h:1", "h", "up", 0.4, "0.1.0", "580", "mps", "native", False, 1),
                                        ServerView("h:2", "h2", "down", 40.0, "0.1.0", "580", "mps", "native", False, 1)),
                    gpus=(GpuView("h:1", "up", gpu, 50, 40 * GIB, 1, reading, (fault,)),),
                    leases=(LeaseView(lease, "active", usage=(SliceUsageRecord(sessions=1, memory_used_bytes=2 * GIB),),
                                      compute_used=(7.5,)),),
                    quotas=((QuotaRecord("user", "alice", 100), 50),), total_units=100, allocated_units=50)
    state = dashboard_state(view, [Event(150.0, "info", "lease job-7 for alice")])
    # Used beside held: a slice that holds 40 GiB and uses 2 GiB is marked mostly unused.
    assert state["gpus"][0]["slices"] == [{"job_key": "job-7", "user": "alice", "account": "physics", "slice": 0,
                                           "memory_bytes": 40 * GIB, "compute_percent": 50, "lease_state": "active",
                                           "memory_used_bytes": 2 * GIB, "compute_used_percent": 7.5, "sessions": 1,
                                           "mostly_unused": True}]
    assert state["gpus"][0]["memory_used_bytes"] == 2 * GIB
    assert state["gpus"][0]["telemetry"]["utilization_percent"] == 12.0
    assert state["gpus"][0]["telemetry"]["source"] == "nvml"
    assert state["gpus"][0]["faults"] == [{"unix": 150.0, "error": "CUDA_ERROR_ILLEGAL_ADDRESS", "cross_tenant": True,
                                           "sessions_ended": 2, "faulting": "job job-7 slice 0"}]
    # Trouble at a glance: down servers, GPUs with faults or uncorrected ECC errors.
    assert (state["capacity"]["servers_down"], state["capacity"]["gpus_faulted"],
            state["capacity"]["gpus_ecc_uncorrected"]) == (1, 1, 1)
    assert state["gpus"][0]["sharing"] == "mps"
    assert state["leases"][0]["age_seconds"] == 60.0 and state["leases"][0]["idle"] is False
    assert state["leases"][0]["slices"][0]["memory_used_bytes"] == 2 * GIB
    assert state["quotas"] == [{"kind": "user", "name": "alice", "limit_units": 100, "used_units": 50}]
    assert state["events"][0]["message"] == "lease job-7 for alice"
    json.dumps(state)   # what the page gets


def test_the_allocated_share_keeps_its_base_when_a_server_goes_down() -> None:
    # Two GPUs held 50% each, one on a server that went down: placement's capacity drops the down
    # one (50 of 100), but the header's base stays every registered GPU (100 of 200).
    gpus = tuple(GpuView(f"h:{n}", state, GpuInfo(f"GPU-{n}", 0, "NVIDIA H100", 80 * GIB, 80 * GIB, "9.0"), 50,
                         40 * GIB, 1) for n, state in ((1, "up"), (2, "down")))
    view = PoolView(now=0.0, servers=(), gpus=gpus, leases=(), quotas=(), total_units=100, allocated_units=50)
    capacity = dashboard_state(view, [])["capacity"]
    assert (capacity["held_units"], capacity["all_units"], capacity["gpus"]) == (100, 200, 2)


# Colour distance (CIE76 in CIELAB) as seen with normal vision and, simulated (Viénot, Brettel and
# Mollon 1999, in linear RGB), with deuteranopia and protanopia.
DICHROMAT = {"deuteranopia": ((0.29275, 0.70725, 0.0), (0.29275, 0.70725, 0.0), (-0.02234, 0.02234, 1.0)),
             "protanopia": ((0.11238, 0.88762, 0.0), (0.11238, 0.88762, 0.0), (0.00401, -0.00401, 1.0))}


def _linear(hex_colour: str) -> tuple[float, ...]:
    channels = (int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return tuple(c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels)


def _lab(rgb: tuple[float, ...]) -> tuple[float, float, float]:
    r, g, b = rgb
    x, y, z = (0.4124 * r + 0.3576 * g + 0.1805 * b) / 0.95047, 0.2126 * r + 0.7152 * g + 0.0722 * b, \
        (0.0193 * r + 0.1192 * g + 0.9505 * b) / 1.08883
    f = [t ** (1 / 3) if t > 0.008856 else 7.787 * t + 16 / 116 for t in (x, y, z)]
    return 116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])


def _seen(hex_colour: str, vision: str) -> tuple[float, float, float]:
    rgb = _linear(hex_colour)
    if vision in DICHROMAT:
        rgb = tuple(min(1.0, max(0.0, sum(m * c for m, c in zip(row, rgb)))) for row in DICHROMAT[vision])
    return _lab(rgb)


def _contrast(a: str, b: str) -> float:
    lum = [0.2126 * r + 0.7152 * g + 0.0722 * b_ for r, g, b_ in (_linear(a), _linear(b))]
    return (max(lum) + 0.05) / (min(lum) + 0.05)


def test_user_colours_are_told_apart_also_by_colour_blind_viewers() -> None:
    import itertools
    import math
    import re

    text = (Path(__file__).parent.parent / "site" / "static" / "app.js").read_text()
    palette = re.findall(r'\["(#[0-9a-f]{6})", "(#[0-9a-f]{6})"\]', text.split("const PALETTE", 1)[1].split(";", 1)[0])
    assert len(palette) == 8
    for vision in ("normal", "deuteranopia", "protanopia"):
        for (a, _), (b, _) in itertools.combinations(palette, 2):
            distance = math.dist(_seen(a, vision), _seen(b, vision))
            assert distance >= 20, f"{a} and {b} are {distance:.1f} apart with {vision}"
    for background, foreground in palette:   # the label on a segment reads (WCAG AA: 4.5)
        assert _contrast(background, foreground) >= 4.5, (background, foreground)


# --- a real pool -----------------------------------------------------------------------------------

def start_pool_with_dashboard(cluster: RgpuCluster, *dispatchers: Path) -> int:
    pool = cluster.start_pool("--dashboard-listen", "127.0.0.1:0", "--dashboard-port-file",
                              str(cluster.root / "dashboard.port"))
    port = wait_for_port_file(cluster.root / "dashboard.port", pool)
    for inventory in dispatchers:
        cluster.start_dispatcher(inventory)
    return port


def admin(cluster: RgpuCluster, port: int, *args: str) -> str:
    env = cluster.env(RGPU_DASHBOARD_URL=f"http://127.0.0.1:{port}")
    done = subprocess.run([sys.executable, "-m", "rgpu.remoting.admin.cli", *args], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def get(port: int, path: str, cookie: str = "", method: str = "GET") -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request(method, path, headers={"Cookie": cookie} if cookie else {})
    reply = conn.getresponse()
    reply.read()
    return reply


@pytest.mark.integration
def test_no_anonymous_access_and_links_work_once(cluster: RgpuCluster) -> None:
    port = start_pool_with_dashboard(cluster)
    for path in ("/", "/api/state", "/static/app.js"):
        assert get(port, path).status == 401, path
    link = admin(cluster, port, "dashboard-url")
    assert link.startswith(f"http://127.0.0.1:{port}/login?t=link1.")
    path = link.removeprefix(f"http://127.0.0.1:{port}")
    assert get(port, path, method="HEAD").status == 200         # a link checker does not spend it
    reply = get(port, path)
    assert reply.status == 303 and reply.getheader("Location") == "/"
    cookie = reply.getheader("Set-Cookie")
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
    session = cookie.split(";")[0]
    assert get(port, path).status == 403                        # each link works once
    state = get(port, "/api/state", session)
    assert state.status == 200 and state.getheader("Content-Type") == "application/json"
    assert get(port, "/", session).getheader("Content-Security-Policy").startswith("default-src 'self'")
    assert get(port, "/api/state", session, method="POST").status == 405   # read-only
    assert get(port, "/api/state", "rgpu_session=sess1.9999999999.00.forged").status == 401
    assert get(port, "/login?t=link1.9999999999.00.forged").status == 403


def login(port: int, link: str) -> str:
    reply = get(port, link.removeprefix(f"http://127.0.0.1:{port}"))
    assert reply.status == 303, reply.status
    return reply.getheader("Set-Cookie").split(";")[0]


@pytest.mark.integration
def test_logout_revokes_the_cookie_and_spent_links_stay_spent_across_a_restart(cluster: RgpuCluster) -> None:
    port = start_pool_with_dashboard(cluster)
    first_link, second_link = admin(cluster, port, "dashboard-url"), admin(cluster, port, "dashboard-url")
    kept, logged_out = login(port, first_link), login(port, second_link)
    assert get(port, "/api/state", logged_out).status == 200
    reply = get(port, "/logout", logged_out)
    assert reply.status == 200 and "Max-Age=0" in reply.getheader("Set-Cookie")
    assert get(port, "/api/state", logged_out).status == 401     # the copied cookie no longer works
    assert get(port, "/api/state", kept).status == 200            # another session is not touched

    assert cluster.pool is not None
    cluster.pool.kill()
    port = start_pool_with_dashboard(cluster)
    for link in (first_link, second_link):
        path = link.split("/login", 1)[1]
        assert get(port, "/login" + path).status == 403, "a spent link worked again after a restart"
    assert get(port, "/api/state", logged_out).status == 401
    assert get(port, "/api/state", kept).status == 200


@pytest.mark.integration
def test_dashboard_url_needs_the_dashboards_address(cluster: RgpuCluster) -> None:
    done = subprocess.run([sys.executable, "-m", "rgpu.remoting.admin.cli", "dashboard-url"], env=cluster.env(),
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert done.stderr.startswith("rgpu: admin: the dashboard's address is unknown (neither dashboard_url nor "
                                  "dashboard_listen is set"), done.stderr


@pytest.mark.integration
def test_listeners_on_port_0_are_logged_with_the_port_they_got(cluster: RgpuCluster) -> None:
    pool = cluster.start_pool("--dashboard-listen", "127.0.0.1:0", "--dashboard-port-file",
                              str(cluster.root / "dashboard.port"), "--metrics-listen", "127.0.0.1:0",
                              "--metrics-port-file", str(cluster.root / "metrics.port"))
    dashboard = wait_for_port_file(cluster.root / "dashboard.port", pool)
    metrics = wait_for_port_file(cluster.root / "metrics.port", pool)
    wait_for(lambda: "serving on" in pool.log(), what="the pool's start line")
    log = pool.log()
    assert f"serving on 127.0.0.1:{cluster.pool_port}," in log
    assert f"metrics on http://127.0.0.1:{metrics}/metrics" in log
    assert f"dashboard on http://127.0.0.1:{dashboard} " in log
    assert "127.0.0.1:0" not in log, log
    # rgpu-admin on this host cannot know the port rgpu-poold picked: it says so, and how to fix it.
    done = subprocess.run([sys.executable, "-m", "rgpu.remoting.admin.cli", "dashboard-url"],
                          env=cluster.env(RGPU_DASHBOARD_LISTEN="127.0.0.1:0"),
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("rgpu: dashboard: the dashboard's port is unknown here (dashboard_listen = "
                                  "'127.0.0.1:0' lets rgpu-poold pick one when it starts; set dashboard_url to the "
                                  "address rgpu-poold's log names"), done.stderr
    assert "127.0.0.1:0/login" not in done.stdout


@pytest.mark.integration
def test_dashboard_over_tls(cluster: RgpuCluster, tmp_path: Path) -> None:
    import ssl

    if shutil.which("openssl") is None:
        pytest.skip("openssl (to make a test certificate) is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    cluster.write_config(heartbeat_interval_seconds=0.5, down_after_seconds=3.0, reclaim_interval_seconds=0.5,
                         tls_cert_file=str(cert), tls_key_file=str(key))
    pool = cluster.start_pool("--dashboard-listen", "127.0.0.1:0", "--dashboard-port-file",
                              str(cluster.root / "dashboard.port"))
    port = wait_for_port_file(cluster.root / "dashboard.port", pool)
    context = ssl.create_default_context(cafile=str(cert))
    conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=context)
    conn.request("GET", "/login?t=" + weblogin.login_link_token(cluster.secret, time.time()))
    reply = conn.getresponse()
    assert reply.status == 303
    assert "; Secure" in reply.getheader("Set-Cookie")


# --- in a browser ----------------------------------------------------------------------------------

def check_layout(page, width: int, screenshot: Path) -> None:  # type: ignore[no-untyped-def]
    """At `width` px: nothing overflows sideways, every GPU's bar has the same width (one scale),
    and each table stays inside its card (scrolling there if it must). The screenshot is kept in
    $RGPU_SCREENSHOT_DIR when set."""
    page.set_viewport_size({"width": width, "height": 900})
    page.wait_for_function(f"window.innerWidth === {width}")
    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0, f"the page is {overflow} px wider than a {width} px window"
    bars = page.evaluate("[...document.querySelectorAll('#gpus .bar.compute')].map(b => b.getBoundingClientRect().width)")
    assert len(bars) == 4 and max(bars) - min(bars) < 1 and min(bars) > 0.4 * width - 200, (width, bars)
    cards = page.evaluate("""[...document.querySelectorAll('table')].map(t => {
        const card = t.closest('section').getBoundingClientRect();
        return [t.id, card.left, card.right, t.parentElement.getBoundingClientRect().right]; })""")
    for table, left, right, scroller in cards:
        assert left >= 0 and right <= width and scroller <= right, (width, table, left, right, scroller)
    page.screenshot(path=str(screenshot), full_page=True)
    if os.environ.get("RGPU_SCREENSHOT_DIR"):
        page.screenshot(path=os.path.join(os.environ["RGPU_SCREENSHOT_DIR"], screenshot.name), full_page=True)

def lease_slice(cluster: RgpuCluster, job_key: str) -> tuple[str, str]:
    with cluster.client() as client:
        lease = client.get_lease(job_key)
    return lease.slices[0].server, lease.slices[0].token


def chromium() -> str:
    """Debian's Chromium (Playwright's own browser download is not used: clusters may be offline)."""
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    pytest.skip("no Chromium to drive: install Debian's `chromium` (./scripts/test.sh does so as root)")


@pytest.mark.integration
def test_dashboard_in_chromium(cluster: RgpuCluster, tmp_path: Path) -> None:
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the test extra")
    browser_path = chromium()
    cluster.write_config(heartbeat_interval_seconds=0.5, down_after_seconds=3.0, reclaim_interval_seconds=0.5,
                         idle_after_seconds=3.0)   # a lease without a session is marked idle after 3 s
    port = start_pool_with_dashboard(cluster, EXAMPLES / "inventory-a.toml", EXAMPLES / "inventory-b.toml")
    wait_for(lambda: len(cluster.client().list_servers().servers) == 2, what="both dispatchers")
    with cluster.client() as client:
        client.set_quota("user", "alice", 300)
    out = admin(cluster, port, "request-gpus", "-n", "2", "-p", "0.5", "--user", "alice", "--account", "physics",
                "--job-key", "slurm-4242", "-o", str(tmp_path / "adaptor.conf"))
    assert "leased 2 slice(s) as slurm-4242" in out
    admin(cluster, port, "request-gpus", "-n", "1", "-p", "0.25", "--user", "bob", "--job-key", "slurm-4243",
          "-o", str(tmp_path / "bob.conf"))

    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 760})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"http://127.0.0.1:{port}/")                 # anonymous: told how to log in
            assert "rgpu-admin dashboard-url" in page.locator("main").inner_text()
            page.goto(admin(cluster, port, "dashboard-url"))
            assert page.url == f"http://127.0.0.1:{port}/"       # the link left the address bar

            # GPU bars: every GPU of both dispatchers; alice's two half slices on two GPUs, bob's
            # quarter packed beside one of them (binpack).
            page.wait_for_selector("#gpus .gpu .seg")
            assert page.locator("#gpus .gpu").count() == 4
            alice = page.locator("#gpus .bar.compute .seg", has_text="slurm-4242")
            assert alice.count() == 2
            assert alice.first.inner_text() == "slurm-4242 · alice · 50%"
            assert alice.first.evaluate("e => e.style.width") == "50%"
            shared = page.locator("#gpus .gpu", has=page.locator(".seg", has_text="bob"))
            assert shared.locator(".bar.compute .seg").count() == 2
            assert "75% compute held" in shared.inner_text() and "60 GiB held / 80 GiB" in shared.inner_text()
            # Readings of each GPU beside what is held; an emulated GPU says so.
            assert page.locator("#gpus .gpu .telemetry .tag", has_text="emulated").count() == 4
            assert "util 0%" in shared.locator(".telemetry").inner_text()
            # The lease, its user and age; the dispatchers up; the quota in use; events.
            row = page.locator("#leases tbody tr", has_text="slurm-4242")
            assert "alice" in row.inner_text() and "physics" in row.inner_text() and "active" in row.inner_text()
            assert page.locator("#servers tbody tr", has_text="up").count() == 2
            assert "100 / 300 GPU-%" in page.locator("#quotas tbody").inner_text()
            page.wait_for_selector("#events li:has-text('lease slurm-4242 for alice')")
            page.wait_for_selector("#leases tbody tr:has-text('slurm-4243') .state.idle", timeout=10_000)
            summary = page.locator("#summary").inner_text()
            assert "2/2 dispatchers up" in summary and "2 leases" in summary and "4 GPUs" in summary
            assert "% of 4 GPUs allocated" in summary
            # Used beside held: a session holds 2 GiB of alice's 40 GiB slice; the page draws the 2 GiB
            # inside the 40 and hatches the slice (mostly unused).
            session = HoldingSession(*lease_slice(cluster, "slurm-4242"), 2 * GIB)
            # Polled from here: the page's CSP (no eval) refuses wait_for_function's string predicates.
            wait_for(lambda: page.evaluate("[...document.querySelectorAll('#gpus .bar.memory .seg .used')]"
                                           ".some(u => u.style.width === '5%')"), what="the 2 GiB drawn in the slice")
            assert page.evaluate("[...document.querySelectorAll('#gpus .bar.memory .seg .used')]"
                                 ".filter(u => u.style.width === '5%').map(u => u.parentElement.className)") == ["seg unused"]
            page.wait_for_selector("#gpus .gpu:has-text('2 GiB used / ')", timeout=10_000)
            assert "40 GiB (uses 2 GiB)" in page.locator("#leases tbody tr", has_text="slurm-4242").inner_text()
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            if os.environ.get("RGPU_SCREENSHOT"):
                page.screenshot(path=os.environ["RGPU_SCREENSHOT"], full_page=True)
            for width in (1440, 820, 390):
                check_layout(page, width, tmp_path / f"dashboard-{width}.png")
            page.set_viewport_size({"width": 1200, "height": 760})

            # Live: a release shows without a reload.
            session.close()
            admin(cluster, port, "release-gpus", "-f", str(tmp_path / "adaptor.conf"))
            page.wait_for_selector("#leases tbody tr:has-text('slurm-4242')", state="detached", timeout=10_000)
            assert page.locator("#gpus .bar.compute .seg").count() == 1   # bob's
            # A dispatcher that stops heartbeating is in the header, in red, at a glance.
            assert page.locator("#alarm-down").count() == 0
            cluster.daemons[-1].kill()
            page.wait_for_selector("#alarm-down:has-text('1 dispatcher(s) down')", timeout=15_000)
            page.screenshot(path=str(tmp_path / "dashboard-down.png"), full_page=True)
            assert not errors, errors
        finally:
            browser.close()
    assert (tmp_path / "dashboard.png").stat().st_size > 10_000
