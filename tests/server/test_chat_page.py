"""The chat page at `/` in a real headless browser (Debian's chromium + chromedriver through selenium):
the embedded model behind `deltaserve serve --api-key`, and the scripted engine for reasoning.

The page must load without the key (its API calls send the one typed into it), stream tokens into the page,
stop a generation (the server counts it aborted, and the next message works), show reasoning collapsed,
and render to a non-blank screenshot."""

from __future__ import annotations

import shutil
import struct
import time
import zlib

import httpx
import pytest

from .conftest import ServerProcess, start_scripted_server

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (the `test` extra)")

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER),
                                reason="no chromium / chromedriver (apt-get install chromium chromium-driver)")

KEY = "page-secret"
LONG = 3000          # tokens: still running when the test clicks stop


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    proc = ServerProcess(["-m", "deltaserve", "serve", "--device", "cpu", "--api-key", KEY,
                          "--uvicorn-log-level", "warning"],
                         tmp_path_factory.mktemp("chat-page") / "server.log").start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1100,800"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def by_id(driver, id_: str):
    return driver.find_element("id", id_)


def wait_for(condition, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def set_field(driver, id_: str, value: str) -> None:
    """Sets an input's value and fires `change` (what typing and leaving the field does)."""
    driver.execute_script("const e = document.getElementById(arguments[0]); e.value = arguments[1];"
                          "e.dispatchEvent(new Event('change'));", id_, value)


def send(driver, text: str) -> None:
    box = by_id(driver, "input")
    box.send_keys(text)
    by_id(driver, "send").click()


def last_assistant(driver):
    return driver.find_elements("css selector", ".msg.assistant")[-1]


def state(driver) -> str:
    return last_assistant(driver).get_attribute("data-state")


def server_metric(server: ServerProcess, name: str) -> float:
    text = httpx.get(f"{server.base}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def png_colours(png: bytes) -> int:
    """Distinct RGB(A) pixels of an 8-bit, non-interlaced RGB / RGBA PNG (what chromium writes)."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, b""
    while pos < len(png):
        length, kind = struct.unpack(">I4s", png[pos:pos + 8])
        data = png[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", data)
            assert depth == 8 and colour in (2, 6) and interlace == 0, (depth, colour, interlace)
        elif kind == b"IDAT":
            idat += data
        pos += 12 + length
    bpp = 3 if colour == 2 else 4
    raw, stride = zlib.decompress(idat), width * bpp
    prev, seen = bytearray(stride), set()
    for y in range(height):
        ftype, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):          # undo the PNG row filter
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if ftype == 1:
                line[i] = (line[i] + a) & 255
            elif ftype == 2:
                line[i] = (line[i] + b) & 255
            elif ftype == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif ftype == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        seen.update(bytes(line[i:i + bpp]) for i in range(0, stride, bpp * 7))   # every 7th pixel is plenty
        prev = line
    return len(seen)


def test_png_colours_counts_distinct_pixels():
    def png(rows: list[bytes], width: int) -> bytes:
        chunk = lambda kind, data: (struct.pack(">I", len(data)) + kind + data
                                    + struct.pack(">I", zlib.crc32(kind + data)))
        raw = b"".join(b"\x00" + r for r in rows)
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, len(rows), 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))

    assert png_colours(png([b"\xff\xff\xff" * 8] * 3, 8)) == 1
    assert png_colours(png([b"\xff\xff\xff" * 8, b"\x00\x00\x00" * 8], 8)) == 2


def test_the_page_loads_without_the_key_and_its_calls_need_it(server, browser):
    page = httpx.get(f"{server.base}/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<script>" in page.text and "://" not in page.text, "the page must not load anything from elsewhere"
    assert httpx.get(f"{server.url}/models", timeout=10).status_code == 401
    browser.get(f"{server.base}/")
    wait_for(lambda: by_id(browser, "error").is_displayed(), what="the 401 shown in the page")
    assert "401" in by_id(browser, "error").text and "API key" in by_id(browser, "error").text
    set_field(browser, "key", KEY)
    wait_for(lambda: by_id(browser, "model").text not in ("", "…", "?"), what="the model name from /v1/models")
    assert not by_id(browser, "error").is_displayed()


def test_streams_a_reply_and_shows_tokens_per_second(server, browser):
    set_field(browser, "max_tokens", "24")
    set_field(browser, "temperature", "0")
    send(browser, "The history of the city")
    wait_for(lambda: state(browser) == "done", what="the reply to finish")
    reply = last_assistant(browser)
    assert reply.find_element("class name", "content").text.strip()
    meta = reply.find_element("class name", "meta").text
    assert "tokens/s" in meta and "counted" not in meta, meta     # from usage (stream_options.include_usage)
    assert not by_id(browser, "error").is_displayed()


def test_stop_ends_the_stream_and_the_server_aborts_it(server, browser):
    aborted = server_metric(server, 'deltaserve_requests_total{outcome="abort"}')
    set_field(browser, "max_tokens", str(LONG))
    set_field(browser, "extra", '{"ignore_eos": true}')
    send(browser, "Once upon a time")
    content = lambda: last_assistant(browser).find_element("class name", "content").text
    first = wait_for(lambda: len(content()), what="the first streamed tokens")
    wait_for(lambda: len(content()) > first, what="more streamed tokens")       # it streams, not all at once
    assert state(browser) == "streaming"
    by_id(browser, "stop").click()
    wait_for(lambda: state(browser) == "stopped", timeout=5, what="the page to show the stop")
    stopped = content()
    wait_for(lambda: server_metric(server, 'deltaserve_requests_total{outcome="abort"}') > aborted,
             timeout=10, what="the server to count the request aborted")
    assert server_metric(server, "deltaserve_num_requests_running") == 0
    time.sleep(0.3)
    assert content() == stopped, "tokens kept arriving after stop"
    assert "stopped" in last_assistant(browser).find_element("class name", "meta").text

    set_field(browser, "max_tokens", "8")
    set_field(browser, "extra", "")
    browser.execute_script("window.sent = []; const f = window.fetch; window.fetch = (url, init) => {"
                           "if (init && init.body) window.sent.push(JSON.parse(init.body)); return f(url, init); };")
    send(browser, "And then")                                     # the conversation goes on
    wait_for(lambda: state(browser) == "done", what="the next reply")
    assert len(browser.find_elements("css selector", ".msg.assistant")) == 3
    [body] = browser.execute_script("return window.sent;")
    assert [m["role"] for m in body["messages"]] == ["user", "assistant"] * 2 + ["user"]
    assert body["messages"][3]["content"].strip() == stopped.strip() and body["max_tokens"] == 8 and body["stream"]
    assert "ignore_eos" not in body


def test_errors_are_shown_in_the_page(server, browser):
    set_field(browser, "extra", '{"no_such_field": 1}')
    send(browser, "Hello")
    wait_for(lambda: state(browser) == "error", what="the refusal")
    assert "no_such_field" in by_id(browser, "error").text
    set_field(browser, "extra", "")


def test_screenshot_is_not_blank(server, browser):
    assert png_colours(browser.get_screenshot_as_png()) > 3


def test_reasoning_is_shown_collapsed(tokenizer_dir, tmp_path, browser):
    scripted = start_scripted_server(tokenizer_dir, tmp_path)
    try:
        browser.get(f"{scripted.base}/")
        wait_for(lambda: by_id(browser, "model").text not in ("", "…"), what="the model name")
        set_field(browser, "key", "")
        send(browser, "[[script:think]] what is 2+2?")
        wait_for(lambda: state(browser) != "streaming", what="the reply")
        assert state(browser) == "done", by_id(browser, "error").text
        reply = last_assistant(browser)
        details = reply.find_element("tag name", "details")
        assert details.is_displayed() and details.get_attribute("open") is None
        assert reply.find_element("class name", "content").text.strip() == "The answer is 4."
        assert "The user wants 2+2" in details.find_element("tag name", "pre").get_attribute("textContent")
    finally:
        scripted.stop()
