"""The web UI in a real headless Chromium (Debian's ``chromium`` and ``chromium-driver``,
driven by selenium through the system ``/usr/bin/chromedriver``) against one
``tokenmill serve --api-key`` subprocess with the default model.

Screenshots of both pages go to ``$WEB_UI_SCREENSHOT_DIR`` if set, else to a
``screenshots`` folder under pytest's temporary directory."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server.test_server import MODEL, RemoteServer

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
KEY = "browser-test-key"
QUESTION = "What is the capital of France?"

if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
    pytest.skip(
        "needs Debian's chromium and chromium-driver (scripts/install.sh --test installs them)",
        allow_module_level=True,
    )


@pytest.fixture(scope="module")
def server() -> Iterator[RemoteServer]:
    srv = RemoteServer(api_key=KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1280,1000",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Path:
    given = os.environ.get("WEB_UI_SCREENSHOT_DIR")
    folder = Path(given) if given else tmp_path_factory.mktemp("screenshots")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def wait(browser: WebDriver, condition: Callable[[WebDriver], object], timeout: float = 30):
    return WebDriverWait(browser, timeout, poll_frequency=0.1).until(condition)


def finished_by_reason(server: RemoteServer) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "tokenmill:request_success":
            for s in family.samples:
                out[s.labels["finished_reason"]] = s.value
    return out


def open_chat(browser: WebDriver, server: RemoteServer) -> None:
    """Load the chat page in a fresh tab state and give it the key it asks for."""
    browser.get(server.url + "/")
    browser.execute_script("sessionStorage.clear()")
    browser.get(server.url + "/")
    wait(browser, lambda b: b.find_element(By.ID, "key-form").is_displayed())
    browser.find_element(By.ID, "api-key").send_keys(KEY)
    browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
    wait(browser, lambda b: b.find_elements(By.CSS_SELECTOR, "#model option"))


def fill(browser: WebDriver, field: str, value: str) -> None:
    element = browser.find_element(By.ID, field)
    element.clear()
    element.send_keys(value)


def last_reply(browser: WebDriver):
    return browser.find_elements(By.CSS_SELECTOR, ".message.assistant")[-1]


def reply_done(browser: WebDriver):
    replies = browser.find_elements(By.CSS_SELECTOR, ".message.assistant[data-finish-reason]")
    return replies[-1] if replies else None


def scrapes(browser: WebDriver) -> int:
    """How many times the engine page has read /metrics."""
    return int(browser.find_element(By.TAG_NAME, "body").get_attribute("data-scrapes") or 0)


def test_without_the_key_the_chat_page_asks_for_it(browser, server):
    browser.get(server.url + "/")
    browser.execute_script("sessionStorage.clear()")
    browser.get(server.url + "/")
    wait(browser, lambda b: b.find_element(By.ID, "key-form").is_displayed())
    assert not browser.find_elements(By.CSS_SELECTOR, "#model option")
    fill(browser, "prompt", QUESTION)
    browser.find_element(By.ID, "send").click()
    wait(browser, lambda b: "API key" in b.find_element(By.ID, "status").text)
    assert browser.find_element(By.ID, "prompt").get_attribute("value") == QUESTION
    assert not browser.find_elements(By.CSS_SELECTOR, ".message")
    browser.find_element(By.ID, "api-key").send_keys("wrong-key")
    browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
    wait(
        browser,
        lambda b: "refused" in b.find_element(By.ID, "api-key").get_attribute("placeholder"),
    )
    assert browser.find_element(By.ID, "key-form").is_displayed()


def test_chat_streams_the_answer(browser, server, screenshots):
    open_chat(browser, server)
    assert [o.text for o in browser.find_elements(By.CSS_SELECTOR, "#model option")] == [MODEL]
    system = "You are a helpful assistant. Answer in one short sentence."
    fill(browser, "system", system)
    fill(browser, "temperature", "0")
    fill(browser, "max-tokens", "16")
    fill(browser, "prompt", QUESTION)
    browser.find_element(By.ID, "send").click()
    reply = wait(browser, reply_done)
    answer = reply.find_element(By.CSS_SELECTOR, ".content").text
    assert int(reply.get_attribute("data-chunks")) > 1
    assert reply.get_attribute("data-finish-reason") in ("stop", "length")
    assert "generated tokens" in reply.find_element(By.CSS_SELECTOR, ".meta").text
    browser.save_screenshot(str(screenshots / "chat.png"))
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}],
        "temperature": 0,
        "top_p": 1,
        "max_tokens": 16,
    }
    expected = server.post("/v1/chat/completions", body).json()["choices"][0]
    assert answer == expected["message"]["content"].strip()
    assert reply.get_attribute("data-finish-reason") == expected["finish_reason"]


def test_stop_aborts_the_request_in_the_engine(browser, server, screenshots):
    open_chat(browser, server)
    before = finished_by_reason(server).get("abort", 0)
    fill(browser, "max-tokens", "2000")
    fill(browser, "extra", '{"ignore_eos": true}')
    fill(browser, "prompt", "Tell me a long story about a lighthouse keeper.")
    browser.find_element(By.ID, "send").click()
    wait(browser, lambda b: int(last_reply(b).get_attribute("data-chunks")) >= 3)
    assert server.metrics()["tokenmill:num_requests_running"] == 1
    browser.find_element(By.ID, "stop").click()
    reply = wait(browser, reply_done)
    assert reply.get_attribute("data-finish-reason") == "stopped"
    assert browser.find_element(By.ID, "status").text == "Stopped."
    server.wait_idle(timeout=10)
    assert finished_by_reason(server).get("abort", 0) == before + 1
    assert browser.find_element(By.ID, "send").is_enabled()
    browser.save_screenshot(str(screenshots / "chat-stopped.png"))


def test_engine_page_numbers_move_under_load(browser, server, screenshots):
    browser.get(server.url + "/engine")
    wait(browser, lambda b: scrapes(b) >= 2)

    def card(name: str) -> str:
        return browser.find_element(By.ID, f"m-{name}").text

    finished_before = int(card("finished").replace(",", ""))
    generated_before = card("gen-total")
    assert card("running") == "0" and card("ttft") == "–"
    assert browser.find_element(By.ID, "engine-status").text.startswith(f"{MODEL} · updated")
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": True}
    stop = threading.Event()
    statuses: list[int] = []

    def client() -> None:
        while not stop.is_set():
            statuses.append(server.post("/v1/completions", body).status_code)

    load = [threading.Thread(target=client) for _ in range(4)]
    for thread in load:
        thread.start()
    seen = {"running": False, "kv": False, "tokens/s": False}
    deadline = time.monotonic() + 60
    try:
        while not all(seen.values()) and time.monotonic() < deadline:
            seen["running"] |= card("running") not in ("0", "–")
            seen["kv"] |= card("kv") not in ("0%", "–")
            seen["tokens/s"] |= card("gen-tps") not in ("0", "–")
            time.sleep(0.2)
        browser.save_screenshot(str(screenshots / "engine-under-load.png"))
    finally:
        stop.set()
        for thread in load:
            thread.join(60)
    assert all(seen.values()), seen
    assert statuses and set(statuses) == {200}
    wait(
        browser, lambda b: int(card("finished").replace(",", "")) == finished_before + len(statuses)
    )
    assert card("gen-total") != generated_before
    assert card("ttft").endswith(("ms", " s")) and card("tpot").endswith(("ms", " s"))
    assert "p90" in card("ttft-q")
    browser.save_screenshot(str(screenshots / "engine.png"))


def test_no_request_outside_the_server(browser, server):
    """Every request the pages made (Chromium's network log) went to the server; the browser
    logged no CSP violation and no error but the API's 401s that make the chat page ask for
    the key."""
    urls = set()
    for entry in browser.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.add(message["params"]["request"]["url"].split("?", 1)[0])
    paths = {url.removeprefix(server.url) for url in urls}
    assert {"/", "/engine", "/ui/chat.js", "/v1/chat/completions", "/metrics"} <= paths
    assert all(url.startswith(server.url + "/") or url.startswith("data:") for url in urls), urls
    errors = [
        e["message"]
        for e in browser.get_log("browser")
        if e["level"] == "SEVERE"
        and "the server responded with a status of 401" not in e["message"]
    ]
    assert not errors
