"""The web chat at `GET /`, in a real headless browser (Debian's Chromium driven by Selenium): load the
page, send a message, see the answer stream in and the figures beside it."""

import os
import shutil

import pytest

from mosaic_shatter.convert import convert
from serving import BUNDLED, ServerProcess

# CI installs Chromium and sets MOSAIC_REQUIRE_BROWSER, so there the test cannot skip itself away.
BROWSER, DRIVER = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
if not (BROWSER and DRIVER):
    if os.environ.get("MOSAIC_REQUIRE_BROWSER"):
        raise RuntimeError("MOSAIC_REQUIRE_BROWSER is set but chromium or chromedriver is missing")
    pytest.skip("no chromium and chromedriver (apt install chromium chromium-driver)", allow_module_level=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("web")
    model = convert(str(BUNDLED), root / "stdlib-q4", "q4", progress=False).out
    proc = ServerProcess([str(model), "--max-seq", "1024"], root / "home")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = BROWSER
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=options)
    yield driver
    driver.quit()


def test_a_message_streams_back_with_its_figures(server, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 60)
    browser.get(server.url + "/")
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#model option"))  # the picker, from /v1/models
    assert browser.find_element(By.ID, "model").text == "stdlib-q4"
    wait.until(lambda d: "experts" in d.find_element(By.ID, "meter").text)  # the ring meter, from /stats

    # Watch the answer's text as the page shows it: it must grow more than once before the answer ends.
    # Every text the page gives the answer is read from the mutation records themselves, not from the page
    # when the observer runs: the bundled model answers in milliseconds, and on loopback its whole stream
    # can arrive in one read, whose updates one observer call would see only the last of.
    browser.execute_script("""
        window.seen = [];
        new MutationObserver(records => {
          for (const r of records)
            if (r.target.classList && r.target.classList.contains('text'))
              for (const node of r.addedNodes) window.seen.push(node.textContent);
        }).observe(document.getElementById('log'), {subtree: true, childList: true, characterData: true});""")
    box = browser.find_element(By.ID, "prompt")
    box.send_keys("What does `json.dumps` do?")
    browser.find_element(By.ID, "send").click()
    figures = wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, ".turn .figures")[-1].text or None)
    answer = browser.find_elements(By.CSS_SELECTOR, ".turn .text")[-1].text
    assert answer and "error" not in browser.find_elements(By.CSS_SELECTOR, ".turn .text")[-1].get_attribute("class")
    for figure in ("TTFT", "tok/s", "prompt tokens", "hit rate", "read"):
        assert figure in figures, figures
    partial = {s for s in browser.execute_script("return window.seen") if s and s != answer}
    assert len(partial) >= 2, "the answer did not stream"

    # A second turn: the page sends the whole conversation, and the server's cache holds the first.
    box.send_keys("And json.loads?")
    browser.find_element(By.ID, "send").click()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".turn .figures")) >= 4
               and d.find_elements(By.CSS_SELECTOR, ".turn .figures")[-1].text)
    second = browser.find_elements(By.CSS_SELECTOR, ".turn .figures")[-1].text
    cached = int(second.split("(")[1].split(" cached")[0])
    assert cached > 0, second
    wait.until(ec.element_to_be_clickable((By.ID, "send")))
