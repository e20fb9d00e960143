"""The chat page at `/`: plain files with no outside URL, and, in a real headless browser (Debian's chromium and
chromedriver driven by Selenium), a question answered as it streams, the stop button, and a 4xx shown."""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmc.runtime.config import RuntimeConfig
from llmc.runtime.llm import LLM
from llmc.serve.app import ServeConfig

from .conftest import Server

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


def test_page_and_assets_are_served_plain(serve_engine_dir: Path) -> None:
    server = Server(LLM(serve_engine_dir, RuntimeConfig(threads=1)), ServeConfig(model_name="tiny", api_key="k"))
    try:
        page = httpx.get(server.url + "/")  # open whatever the API key: the page asks for it
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        for asset, kind in (("static/chat.js", "text/javascript"), ("static/chat.css", "text/css")):
            r = httpx.get(f"{server.url}/{asset}")
            assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
            assert f'"{asset}"' in page.text
            assert not re.search(r"https?://", r.text), f"{asset} reaches outside the server"
        assert not re.search(r"(src|href)=\"(https?:)?//", page.text), "the page loads something from outside"
        assert httpx.get(server.url + "/static/other.js").status_code == 404
        assert httpx.get(server.url + "/v1/models").status_code == 401  # the API itself stays behind the key
    finally:
        server.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not (CHROMIUM and CHROMEDRIVER):  # `make test` installs them (its browser target)
        pytest.fail("chromium and chromedriver are not installed: make test installs them "
                    "(apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1200,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def smollm2_server(smollm2: Any) -> Iterator[Server]:
    server = Server(LLM(smollm2.engine_dir, RuntimeConfig(threads=2, max_step_tokens=512)),
                    ServeConfig(model_name="smollm2"))
    yield server
    server.stop()


def _ask(driver: Any, text: str) -> None:
    from selenium.webdriver.common.by import By

    box = driver.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(text)
    driver.find_element(By.ID, "send").click()


def _set(driver: Any, field: str, value: str) -> None:
    from selenium.webdriver.common.by import By

    el = driver.find_element(By.ID, field)
    el.clear()
    el.send_keys(value)


def _answer(driver: Any) -> str:
    return str(driver.execute_script(
        "const m = document.querySelectorAll('.msg.assistant'); return m.length ? m[m.length - 1].textContent : ''"))


def _watch_stream(driver: Any) -> None:
    """Record in the page every text the answer shows while it streams: polling from here through the driver can miss
    a short answer whole on a loaded machine, the page's own observer sees each rendering."""
    driver.execute_script("""
        window.llmcSeen = [];
        new MutationObserver(() => {
          const m = document.querySelector('.msg.assistant.streaming');
          const seen = window.llmcSeen;
          if (m && m.textContent && seen[seen.length - 1] !== m.textContent) seen.push(m.textContent);
        }).observe(document.body, { subtree: true, childList: true, characterData: true });""")


def _streaming(driver: Any) -> bool:
    return bool(driver.execute_script("return document.querySelector('.msg.assistant.streaming') !== null"))


@pytest.mark.slow
def test_paris_streams_in(browser: Any, smollm2_server: Server) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(smollm2_server.url + "/")
    WebDriverWait(browser, 10).until(ec.text_to_be_present_in_element((By.ID, "model"), "smollm2"))
    _set(browser, "temperature", "0")
    _set(browser, "max_tokens", "48")
    _watch_stream(browser)
    _ask(browser, "What is the capital of France?")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (_streaming(browser) or not _answer(browser)):
        time.sleep(0.05)
    seen: list[str] = browser.execute_script("return window.llmcSeen")  # the answer's text while it streamed
    final = _answer(browser)
    assert "Paris" in final, final
    assert len(seen) >= 2 and all(final.startswith(s) for s in seen), f"no stream seen: {seen}"
    assert browser.find_element(By.ID, "error").get_attribute("hidden") is not None
    assert not browser.find_element(By.ID, "send").get_attribute("disabled")
    assert "tokens in" in browser.find_element(By.ID, "stats").text


@pytest.mark.slow
def test_stop_button_ends_the_stream(browser: Any, smollm2_server: Server) -> None:
    from selenium.webdriver.common.by import By

    browser.get(smollm2_server.url + "/")
    _set(browser, "max_tokens", "400")
    _ask(browser, "Write a long story about a dragon.")
    deadline = time.monotonic() + 60
    while len(_answer(browser)) < 20 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _streaming(browser)
    browser.find_element(By.ID, "stop").click()
    deadline = time.monotonic() + 10
    while _streaming(browser) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _streaming(browser) and "(stopped)" in _answer(browser)
    smollm2_server.wait_idle()  # the server saw the disconnect and freed the sequence


@pytest.mark.slow
def test_a_4xx_is_shown(browser: Any, smollm2_server: Server) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(smollm2_server.url + "/")
    WebDriverWait(browser, 10).until(ec.text_to_be_present_in_element((By.ID, "model"), "smollm2"))
    _set(browser, "max_tokens", "1000000")  # more than the context holds: the server answers 400
    _ask(browser, "What is the capital of France?")
    err = WebDriverWait(browser, 20).until(ec.visibility_of_element_located((By.ID, "error")))
    assert err.text.startswith("Error 400: ") and "exceeds the context" in err.text, err.text
    assert browser.find_elements(By.CSS_SELECTOR, ".msg") == []  # nothing of the refused turn is left
    assert browser.find_element(By.ID, "prompt").get_attribute("value") == "What is the capital of France?"
    _set(browser, "max_tokens", "8")  # the conversation goes on after the error
    _ask(browser, "Hello")
    WebDriverWait(browser, 60).until(lambda d: _answer(d) and not _streaming(d))
    assert err.get_attribute("hidden") is not None
