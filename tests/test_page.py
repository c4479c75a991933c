"""The dashboard in a real headless browser (Debian's Chromium, driven by Playwright)
against a real ``mlxq serve`` and a real worker: it loads, shows the worker and a job
submitted after it loaded, follows that job's stream, and never reloads.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mlxq.producer import Client

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


def test_dashboard_shows_the_worker_and_a_new_job_live(
    start_worker, start_gateway, queue_name, redis_server, tiny_model, tmp_path: Path
):
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no {CHROMIUM}: install Debian's chromium (make browser) to run this test")
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is missing: pip install 'mlxq[dev]'"
    )
    worker = start_worker()
    gateway = start_gateway()
    expect = sync_api.expect
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(f"{gateway.url}/")
            page.evaluate("window.loadedOnce = true")  # gone if the page ever reloads

            row = page.locator(f'#workers tr[data-worker="{worker.name}"]')
            expect(row).to_contain_text(str(tiny_model), timeout=WAIT_MS)
            expect(row).to_contain_text(queue_name)
            # The queue shows as soon as a worker serves it, before any job.
            expect(page.locator(f'#queues tr[data-queue="{queue_name}"]')).to_be_visible(
                timeout=WAIT_MS
            )

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
        finally:
            browser.close()
