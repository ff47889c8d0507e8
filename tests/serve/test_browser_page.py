"""The browser page at ``/``: served from the package, and used for real in headless Chromium
(Debian's chromium and chromedriver, driven by selenium) with a fake microphone that plays a WAV.

Set CADENCE_FX_SCREENSHOT=bench/results/browser_page.png to keep the screenshot docs/serving.md shows."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from servekit import AUDIO, ROOMY, Server, TalkingTone, running

from cadence_fx.serve.access import Access
from cadence_fx.serve.app import STATIC, background_server

# As root, in a closed network: no sandbox, nothing that phones home (the machine notes' flags).
CHROMIUM_FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--use-fake-ui-for-media-stream",
    "--use-fake-device-for-media-stream",
    "--autoplay-policy=no-user-gesture-required",
    "--window-size=1000,920",
]


def test_the_page_and_its_files_are_served_from_the_package(server):
    with httpx.Client(base_url=server.handle.http_url) as http:
        page = http.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert page.text == (STATIC / "index.html").read_text()
        for name in ("app.js", "capture-worklet.js", "style.css"):
            answer = http.get(f"/static/{name}")
            assert answer.status_code == 200 and answer.text == (STATIC / name).read_text(), name
    # No external CDN: every script and stylesheet the page loads is one of its own.
    assert "http://" not in page.text and "https://" not in page.text


def _options(tmp_path) -> webdriver.ChromeOptions:
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--use-file-for-fake-audio-capture={AUDIO / 'turns_24k.wav'}")
    options.add_argument(f"--user-data-dir={tmp_path / 'profile'}")
    return options


def test_a_missing_or_wrong_key_is_said_in_words_not_only_as_1006(tmp_path):
    """A refused WebSocket handshake reaches the page only as close code 1006: the page asks an HTTP
    route why and says it."""
    shown = []
    with running(ROOMY, Access(api_key="sk-page-test")) as server:
        browser = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=_options(tmp_path))
        try:
            browser.get(server.handle.http_url + "/")
            for key in ("", "sk-wrong"):
                browser.find_element("id", "key").clear()
                if key:
                    browser.find_element("id", "key").send_keys(key)
                browser.find_element("id", "start").click()
                deadline = time.monotonic() + 20
                while not (status := browser.find_element("id", "status").text).startswith("closed"):
                    assert time.monotonic() < deadline, status
                    time.sleep(0.1)
                shown.append(status)
        finally:
            browser.quit()
    assert shown == [
        "closed (1006: the server asks for an API key: enter it in the key field)",
        "closed (1006: the server refused this API key)",
    ]


def test_a_spoken_turn_is_answered_and_played_and_speech_over_the_reply_barges_in(tmp_path):
    # turns_24k.wav: a question, a pause, an interruption. The tone double's reply to the first
    # turn plays for 2.4 s, so the second utterance starts while it plays: a barge-in.
    options = _options(tmp_path)
    screenshot = Path(os.environ.get("CADENCE_FX_SCREENSHOT", tmp_path / "page.png"))
    # The tone double with a text source: each chunk's transcript is its number (servekit.TalkingTone).
    with background_server(TalkingTone, ROOMY) as handle:
        server = Server(handle)
        browser = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
        try:
            browser.get(server.handle.http_url + "/")
            models = browser.execute_script(
                "return new Promise(r => { const s = document.getElementById('model');"
                " const poll = () => s.options.length ? r([...s.options].map(o => o.value)) : setTimeout(poll, 50); poll(); })"
            )
            browser.find_element("id", "start").click()
            deadline = time.monotonic() + 45
            while (stats := browser.execute_script("return window.cadence"))["replies"] < 2 or stats["playing"]:
                assert time.monotonic() < deadline, stats
                time.sleep(0.25)
            shown = {name: browser.find_element("id", name).text for name in ("turns", "replies", "barge-ins", "transcript")}
            browser.save_screenshot(str(screenshot))
        finally:
            browser.quit()
    assert models == ["tone"]
    assert stats["sessionId"].startswith("sess_") and stats["errors"] == []
    assert (stats["turns"], stats["replies"], stats["bargeIns"]) == (2, 2, 1)
    transcript = shown.pop("transcript")
    assert shown == {"turns": "2", "replies": "2", "barge-ins": "1"}
    # The live transcript: a line per reply, each the reply's chunks' words in order. TalkingTone
    # numbers its chunks per session: the first reply says w0, w1, ... until the barge-in cut it; the
    # second goes on from past it (a chunk made as the cut came is dropped, never shown).
    lines = stats["transcript"].split("\n")
    assert len(lines) == 2 and transcript.strip() == stats["transcript"].strip()
    numbers = [[int(word[1:]) for word in line.split()] for line in lines]
    assert numbers[0] == list(range(len(numbers[0])))
    assert numbers[1] == list(range(numbers[1][0], numbers[1][0] + len(numbers[1]))) and numbers[1][0] >= len(numbers[0])
    # The second reply played to its end, the first only until the barge-in stopped it.
    assert 0 < stats["playedMs"] < stats["receivedSamples"] * 1000 / 24_000
    assert len(stats["latenciesMs"]) == 2 and all(ms >= 0 for ms in stats["latenciesMs"])
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_jitter_buffer_plays_uneven_chunks_back_to_back(tmp_path):
    """The page's scheduler (``schedule`` in app.js, run in Chromium) against chunks of 40 ms that
    arrive up to 100 ms late, in a fixed pseudo-random order: every chunk after the first starts
    where the one before it ends. The rule before it (20 ms ahead of the arrival) left gaps."""
    simulate = """
      const chunk = 0.04, late = [];
      let seed = 7;
      for (let i = 0; i < 200; i++) { seed = (seed * 1103515245 + 12345) % 2147483648; late.push(0.1 * seed / 2147483648); }
      function gaps(rule) {
        let playhead = 0, count = 0;
        for (let i = 0; i < late.length; i++) {
          const now = i * chunk + late[i];
          const start = rule(playhead, now, i > 0);
          if (i > 0 && start > playhead + 1e-9) count += 1;
          playhead = start + chunk;
        }
        return count;
      }
      return [gaps((p, now, started) => window.cadenceSchedule(p, now, started).start),
              gaps((p, now) => Math.max(p, now + 0.02))];
    """
    browser = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=_options(tmp_path))
    try:
        with running() as server:
            browser.get(server.handle.http_url + "/")
            buffered, before = browser.execute_script(simulate)
    finally:
        browser.quit()
    assert (buffered, before > 0) == (0, True)
