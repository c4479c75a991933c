"""The dashboard in a real headless browser (Debian's Chromium, driven by Playwright)
against a real ``mlxq serve`` and a real worker: it loads, shows the worker and a job
submitted after it loaded, follows that job's stream, and never reloads; a worker that
serves two levels shows its queues grouped by level and the rows it paused. Its first
paint has the state (no request needed), jobs newest first, a failed job's reason, and
cancel and retry buttons that work, behind the API key where there is one.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opshelp import wait_for

from mlxq.producer import Client, JobFailed

pytestmark = pytest.mark.e2e

CHROMIUM = "/usr/bin/chromium"
# Headless without the sandbox (root in a container), and nothing that calls home.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
WAIT_MS = 30_000


@pytest.fixture
def browser() -> Iterator[Any]:
    """A headless Chromium (the test skips where there is none)."""
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no {CHROMIUM}: install Debian's chromium (make browser) to run this test")
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is missing: pip install 'mlxq[dev]'"
    )
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            yield browser
        finally:
            browser.close()


def test_dashboard_shows_the_worker_and_a_new_job_live(
    browser, start_worker, start_gateway, queue_name, redis_server, tiny_model, tmp_path: Path
):
    from playwright.sync_api import expect

    worker = start_worker()
    gateway = start_gateway()
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(f"{gateway.url}/")
    page.evaluate("window.loadedOnce = true")  # gone if the page ever reloads

    row = page.locator(f'#workers tr[data-worker="{worker.name}"]')
    expect(row).to_contain_text(str(tiny_model), timeout=WAIT_MS)
    expect(row).to_contain_text(queue_name)
    # One queue: no row can pause, so no columns for paused rows.
    expect(page.locator("#workers th.lv")).to_have_count(2)
    for cell in page.locator("#workers .lv").all():
        expect(cell).to_be_hidden()
    # The queue shows as soon as a worker serves it, before any job.
    expect(page.locator(f'#queues tr[data-queue="{queue_name}"]')).to_be_visible(timeout=WAIT_MS)

    job = Client(redis_server.url, queue=queue_name).submit(
        "The page shows this job", max_tokens=300, temperature=1.0, seed=5
    )
    job_row = page.locator(f'#jobs tr[data-job="{job.id}"]')
    expect(job_row).to_be_visible(timeout=WAIT_MS)
    expect(page.locator(f'#queues tr[data-queue="{queue_name}"]')).to_be_visible()
    job_row.locator("a[data-follow]").click()
    expect(page.locator("#follow-id")).to_have_text(job.id)
    expect(page.locator("#follow-meta")).to_contain_text("ended: length", timeout=WAIT_MS)
    assert page.locator("#follow-text").text_content() == job.result(timeout=30).text
    expect(job_row.locator(".st")).to_have_text("finished", timeout=WAIT_MS)
    expect(page.locator("#chart polyline")).to_have_count(1)
    assert page.evaluate("window.loadedOnce") is True
    assert "?job=" + job.id in page.url

    shot = tmp_path / "dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    print(f"dashboard screenshot: {shot}")


def _long(url: str, queue: str, tokens: int, seed: int) -> Any:
    """A job that decodes exactly ``tokens`` tokens unless canceled."""
    client = Client(url, queue=queue)
    return client.submit(
        "A long tale", max_tokens=tokens, min_tokens=tokens, temperature=1.0, seed=seed
    )


def test_dashboard_groups_queues_by_level_and_shows_paused_rows(
    browser, start_worker, start_gateway, queue_name, redis_server, tmp_path: Path
):
    from playwright.sync_api import expect

    hi, lo = f"{queue_name}-hi", f"{queue_name}-lo"
    worker = start_worker([hi, lo], max_batch=1, window_ms=0)
    gateway = start_gateway()
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(f"{gateway.url}/")

    # One group for the worker's layout: its queues by level, the highest first.
    group = page.locator(f'#queues tr.group[data-levels="{hi} > {lo}"]')
    expect(group).to_contain_text(worker.name, timeout=WAIT_MS)
    levels = page.locator("#queues tr[data-level]")
    expect(levels).to_have_count(2)
    assert levels.evaluate_all("rs => rs.map(r => [r.dataset.queue, r.dataset.level])") == [
        [hi, "1"],
        [lo, "2"],
    ]
    row = page.locator(f'#workers tr[data-worker="{worker.name}"]')
    expect(row).to_contain_text(f"{hi} > {lo}")
    expect(row.locator("td.paused")).to_have_text("0")
    expect(page.locator("#workers th.lv").first).to_be_visible()

    # The one row runs a long low job; high ones pause it within a decode step, and it
    # stays paused while any of them is left (each runs some seconds alone).
    low = _long(redis_server.url, lo, 2000, seed=0)
    wait_for(lambda: low.status() == "started", "the low job to start")
    highs = [_long(redis_server.url, hi, 2000, seed=i) for i in range(1, 4)]
    expect(row.locator("td.paused")).to_have_text("1", timeout=WAIT_MS)
    expect(row.locator("td.pauses")).to_have_text("1 / 0")  # paused / resumed, ever
    shot = tmp_path / "dashboard-levels.png"
    page.screenshot(path=str(shot), full_page=True)
    print(f"dashboard screenshot: {shot}")

    # The high jobs end (canceled, the running one last) and the low one goes back into
    # its row.
    for job in reversed(highs):
        # A fast machine may finish a high job's 2,000 tokens before its cancel: ended either way.
        assert job.cancel() or job.status() == "finished"
    expect(row.locator("td.paused")).to_have_text("0", timeout=WAIT_MS)
    expect(row.locator("td.pauses")).to_have_text("1 / 1", timeout=WAIT_MS)
    assert low.cancel()


def _ours(page: Any, ids: list[str]) -> list[str]:
    """The page's job rows, top to bottom, of these jobs only."""
    rows = page.locator("#jobs tr[data-job]").evaluate_all("rs => rs.map(r => r.dataset.job)")
    return [i for i in rows if i in ids]


def test_first_paint_jobs_newest_first_reasons_cancel_and_retry(
    browser, start_worker, start_gateway, queue_name, redis_server, tmp_path: Path
):
    from playwright.sync_api import expect

    worker = start_worker()
    idle = f"{queue_name}-idle"  # no worker yet: its job waits there until one starts
    waiting = Client(redis_server.url, queue=idle).submit("Wait", max_tokens=8, temperature=0.0)
    client = Client(redis_server.url, queue=queue_name)
    done = client.submit("Done", max_tokens=4, temperature=0.0)
    done.result(timeout=60)
    bad = client.submit("Too long", max_tokens=4000)  # past the model's context: it fails
    with pytest.raises(JobFailed) as failed:
        bad.result(timeout=60)
    assert "context" in failed.value.reason
    ids = [waiting.id, done.id, bad.id]

    gateway = start_gateway()
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    # Every poll refused: what shows is what the page came with, painted on load.
    page.route("**/dashboard/api/state", lambda route: route.abort())
    page.goto(f"{gateway.url}/")
    shot = tmp_path / "first-paint.png"
    page.screenshot(path=str(shot), full_page=True)
    print(f"first paint: {shot}")
    assert page.locator(f'#workers tr[data-worker="{worker.name}"]').count() == 1
    assert page.locator(f'#queues tr[data-queue="{queue_name}"]').count() == 1
    assert page.locator("#status").text_content() != "connecting..."
    # Newest first; the failed job says why.
    assert _ours(page, ids) == [bad.id, done.id, waiting.id]
    bad_row = page.locator(f'#jobs tr[data-job="{bad.id}"]')
    assert bad_row.locator(".st").text_content() == "failed"
    assert bad_row.locator(".reason").text_content() == failed.value.reason
    assert page.locator(f'#jobs tr[data-job="{done.id}"] .reason').text_content() == ""
    # Buttons by state: an ended job has no cancel, a queued one no retry.
    assert page.locator(f'#jobs tr[data-job="{done.id}"] button').count() == 0
    assert bad_row.locator("button").all_text_contents() == ["retry"]
    waiting_row = page.locator(f'#jobs tr[data-job="{waiting.id}"]')
    assert waiting_row.locator("button").all_text_contents() == ["cancel"]
    page.unroute("**/dashboard/api/state")

    waiting_row.locator('button[data-action="cancel"]').click()
    expect(waiting_row.locator(".st")).to_have_text("canceled", timeout=WAIT_MS)
    expect(page.locator("#notice")).to_contain_text("canceled")
    assert waiting.status() == "canceled"
    waiting_row.locator('button[data-action="retry"]').click()
    expect(waiting_row.locator(".st")).to_have_text("queued", timeout=WAIT_MS)
    assert _ours(page, ids)[0] == waiting.id  # queued again just now: the newest
    start_worker(idle)
    expect(waiting_row.locator(".st")).to_have_text("finished", timeout=WAIT_MS)
    again = Client(redis_server.url, queue=idle).submit("Wait", max_tokens=8, temperature=0.0)
    assert waiting.result(timeout=60).text == again.result(timeout=60).text


def test_with_an_api_key_the_page_asks_for_it_before_it_shows_or_acts(
    browser, start_gateway, queue_name, redis_server
):
    from playwright.sync_api import expect

    job = Client(redis_server.url, queue=queue_name).submit("Wait", max_tokens=2)  # no worker
    gateway = start_gateway(api_key="k-page")
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(f"{gateway.url}/")
    assert job.id not in page.content()  # the state is the key holder's: not in the page
    expect(page.locator("#login")).to_be_visible(timeout=WAIT_MS)
    expect(page.locator("#status")).to_have_text("API key needed")
    page.fill("#key", "k-page")
    page.press("#key", "Enter")
    row = page.locator(f'#jobs tr[data-job="{job.id}"]')
    expect(row.locator(".st")).to_have_text("queued", timeout=WAIT_MS)
    row.locator('button[data-action="cancel"]').click()
    expect(row.locator(".st")).to_have_text("canceled", timeout=WAIT_MS)
    assert job.status() == "canceled"
