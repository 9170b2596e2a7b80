"""The dashboard in headless Chromium (Debian's chromium and chromium-driver, driven by Selenium):
a live short run's and then the finished run's. Every panel must show something and none an
error, every chart is drawn (uPlot's canvas) and hovering over one shows its values in its
legend; the screenshots are kept in artifacts/dashboard/ (README's come from here). Skipped, saying
why, where Chromium cannot start. Marked `browser` (make test-browser; .ci/run runs it)."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium (the test extras) is not installed")

from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support import expected_conditions as ec  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from tests.conftest import finished_dashboard, run_auth  # noqa: E402
from tests.e2e.test_cli_run import start_run  # noqa: E402

pytestmark = pytest.mark.browser
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "dashboard"
QUICKSTART = Path(__file__).resolve().parents[2] / "deploy" / "configs" / "quickstart.yaml"
CHARTS = ("reward", "step-time", "samples", "train", "staleness", "versions")
NUMBER = re.compile(r"^-?[\d.,]+(e[-+]?\d+)?$")
CHROMIUM, DRIVER = (
    shutil.which("chromium") or "/usr/bin/chromium",
    shutil.which("chromedriver") or "/usr/bin/chromedriver",
)


@pytest.fixture(scope="module")
def browser():
    if not (Path(CHROMIUM).exists() and Path(DRIVER).exists()):
        pytest.skip(
            f"Chromium or its driver is missing ({CHROMIUM}, {DRIVER}): apt-get install chromium chromium-driver"
        )
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1300,2500",
    ):
        opts.add_argument(arg)
    try:
        driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    except Exception as e:  # no display libraries, a sandbox refused, ...
        pytest.skip(f"Chromium cannot start here: {str(e).splitlines()[0][:300]}")
    driver.set_page_load_timeout(30)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    yield driver
    driver.quit()


def _log_in(driver, url: str, token: str) -> None:
    driver.delete_all_cookies()
    driver.get(url + "/")
    assert "/login" in driver.current_url  # no token, no dashboard
    driver.find_element(By.NAME, "token").send_keys(token)
    driver.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    WebDriverWait(driver, 20).until(ec.presence_of_element_located((By.ID, "services")))


def _hover_values(driver, chart: str) -> list[str]:
    """The values the chart's legend shows with the pointer over the middle of its plot (uPlot's
    cursor: its legend's rows after the x row)."""
    over = driver.find_element(By.CSS_SELECTOR, f"#chart-{chart} .u-over")
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", over)
    ActionChains(driver).move_to_element_with_offset(over, 0, 0).move_by_offset(3, 0).perform()  # from its centre
    rows = driver.find_elements(By.CSS_SELECTOR, f"#chart-{chart} .u-legend .u-series")
    return [r.find_element(By.CSS_SELECTOR, ".u-value").text.strip() for r in rows[1:]]


def _check_charts(driver, name: str) -> None:
    """Every chart is drawn by uPlot (a canvas), and hovering over the reward curve shows a number
    in its legend."""
    WebDriverWait(driver, 20).until(lambda d: all(d.find_elements(By.CSS_SELECTOR, f"#chart-{c} canvas") for c in CHARTS),
                                    f"{name}: a chart was not drawn")  # fmt: skip
    WebDriverWait(driver, 10).until(lambda d: any(NUMBER.match(v) for v in _hover_values(d, "reward")),
                                    f"{name}: hovering over the rewards chart shows no value in its legend")  # fmt: skip
    assert any(NUMBER.match(v) for v in _hover_values(driver, "step-time")), f"{name}: step time shows no value"


def _check_page(driver, name: str) -> None:
    """Every panel shows something, none an error, every chart is drawn; the page is saved as a screenshot."""
    _check_charts(driver, name)
    panels = driver.find_elements(By.CSS_SELECTOR, ".panel")
    assert panels, f"{name}: no panel"
    for i, p in enumerate(panels):
        text = p.text.strip()
        assert text or p.find_elements(By.TAG_NAME, "canvas"), f"{name}: panel {i} is empty"
        assert not p.find_elements(By.CSS_SELECTOR, ".empty"), f"{name}: panel {i} says {text[:120]!r}"
        assert "NOT BALANCED" not in text and "Traceback" not in text, f"{name}: panel {i}: {text[:300]}"
    assert not driver.find_elements(By.CSS_SELECTOR, "p.bad"), driver.find_element(By.CSS_SELECTOR, "p.bad").text
    driver.save_screenshot(str(ARTIFACTS / f"{name}.png"))


def _lineage(driver, url: str, name: str) -> None:
    driver.get(url + "/step/3")
    rows = driver.find_elements(By.CSS_SELECTOR, "table tr")
    assert len(rows) == 1 + 16 * 8 and driver.find_elements(By.CSS_SELECTOR, ".seg"), "step 3's samples"
    driver.save_screenshot(str(ARTIFACTS / f"{name}-step.png"))
    driver.find_element(By.CSS_SELECTOR, "table tr td a").click()  # its first prompt's history
    assert driver.find_element(By.ID, "fate").text == "trained"
    driver.save_screenshot(str(ARTIFACTS / f"{name}-prompt.png"))


def test_the_dashboard_of_a_live_run_and_of_the_finished_run(browser, tmp_path):
    run_dir = tmp_path / "run"
    # the default job's recipe, shorter: a run that learns, so that every panel, the length guard's
    # included, has nothing to report (start_run's small batches without the entropy bonus can
    # collapse onto answers that run to the limit, which the overview rightly flags)
    proc = start_run(tmp_path, "--config", str(QUICKSTART), "--rollout-batch-size", "16", "--n-samples-per-prompt", "8",
                     "--num-rollout", "150", "--eval-interval", "10", "--run-dir", str(run_dir))  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not (
            (run_dir / "metrics.jsonl").exists()
            and len((run_dir / "metrics.jsonl").read_text().splitlines()) >= 12
            and (run_dir / "eval.jsonl").exists()
            and len((run_dir / "eval.jsonl").read_text().splitlines()) >= 2
        ):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the run never got 12 steps and two eval points"
            time.sleep(0.2)
        url = json.loads((run_dir / "services.json").read_text())["dashboard"]
        token = run_auth(run_dir)["Authorization"].split()[1]
        seen = time.time()  # the dashboard's next background refresh reads what is on disk now
        while httpx.get(url + "/readyz", timeout=5).json()["refreshed_at"] <= seen:
            assert proc.poll() is None and time.monotonic() < deadline, "the dashboard never read the run again"
            time.sleep(0.2)
        _log_in(browser, url, token)
        assert "live" in browser.find_element(By.CSS_SELECTOR, ".facts").text
        _check_page(browser, "live")
        _lineage(browser, url, "live")
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]

    with finished_dashboard(run_dir) as url:
        _log_in(browser, url, token)
        assert "finished" in browser.find_element(By.CSS_SELECTOR, ".facts").text
        assert "step 150/150" in browser.find_element(By.CSS_SELECTOR, ".facts").text
        _check_page(browser, "finished")
        services = browser.find_element(By.ID, "services").text
        assert "exited 0" in services and "not running" not in services, services
        browser.get(url + "/?x=time")
        _check_page(browser, "finished-wall-clock")
        _lineage(browser, url, "finished")
