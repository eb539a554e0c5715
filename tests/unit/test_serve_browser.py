"""The chat page end to end in headless Chromium (Debian `chromium` + `chromium-driver`, driven by selenium):
type a question, watch the streamed text grow, stop it, regenerate with other settings; and a calculator
conversation, whose call and result show as a block of their own and go back to the server as history.

The page and API come from the same FastAPI app and ChatServer that the Ray Serve ingress and replicas run,
served here by uvicorn on loopback (test_serve_ray.py covers the Ray transport). Each engine event is
delayed by 40 ms so that streaming is slow enough to watch and to stop, and the stopped reply is long: the
random model of seed 1 answers the question greedily with 243 tokens (max tokens left empty, the page's default:
the rest of the 256-token context; ~10 s of streaming), so
Stop lands mid-stream also on a loaded machine (seed 0's reply is 22 tokens, under a second: a slow browser
step let it finish before Stop and no cancellation was counted).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
from support.serve_helpers import tiny_model_and_tokenizer

from raychat.checkpoint import load_model
from raychat.serve.ingress import LocalClient, create_app
from raychat.serve.server import ChatServer

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the test extra")
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER),
    reason="needs Debian's headless browser: apt-get install -y chromium chromium-driver",
)


class SlowClient(LocalClient):
    """Delays every event by `delay_s` and records the requests the page sends."""

    def __init__(self, engine, delay_s: float):
        super().__init__(engine)
        self.delay_s, self.requests = delay_s, []

    async def generate(self, request):
        self.requests.append(request)
        events = self.engine.generate(request)
        try:
            async for ev in events:
                await asyncio.sleep(self.delay_s)
                yield ev
        finally:
            await events.aclose()


def serve_page(engine, client):
    """uvicorn on a free loopback port in a thread; yields the page URL, stops the server and engine."""
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(create_app(client), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        srv.should_exit = True
        thread.join(10)
        engine.shutdown()


@pytest.fixture(scope="module")
def server():
    engine = ChatServer(*tiny_model_and_tokenizer(seed=1), max_slots=2, model_id="tiny")
    client = SlowClient(engine, delay_s=0.04)
    for url in serve_page(engine, client):
        yield url, engine, client


@pytest.fixture(scope="module")
def calculator_server(tool_checkpoint):
    model, tokenizer, _ = load_model(tool_checkpoint)
    engine = ChatServer(model, tokenizer, max_slots=2, model_id="calc")
    client = SlowClient(engine, delay_s=0.0)
    for url in serve_page(engine, client):
        yield url, client


@pytest.fixture(scope="module")
def short_context_server():
    """Rows of 40 tokens: the third or so exchange of a conversation no longer fits."""
    engine = ChatServer(*tiny_model_and_tokenizer(seed=1), max_slots=1, max_len=40, model_id="tiny")
    client = SlowClient(engine, delay_s=0.0)
    for url in serve_page(engine, client):
        yield url, engine, client


class FirstEventLate(SlowClient):
    """Holds each reply's first event back `delay_s` (then streams the rest at once), so Stop lands before any
    text arrives."""

    async def generate(self, request):
        self.requests.append(request)
        events = self.engine.generate(request)
        try:
            first = True
            async for ev in events:
                if first:
                    await asyncio.sleep(self.delay_s)
                    first = False
                yield ev
        finally:
            await events.aclose()


@pytest.fixture(scope="module")
def late_server():
    engine = ChatServer(*tiny_model_and_tokenizer(seed=1), max_slots=1, model_id="tiny")
    client = FirstEventLate(engine, delay_s=1.5)
    for url in serve_page(engine, client):
        yield url, client


SILENT = "say nothing"


class TextDropped(SlowClient):
    """Drops the text of the reply to SILENT, whose stream still ends with its done event: a reply of no
    visible characters, as when the model's first token ends its turn."""

    async def generate(self, request):
        silent = request["messages"][-1]["content"] == SILENT
        events = super().generate(request)
        try:
            async for ev in events:
                if not (silent and ev["type"] == "delta"):
                    yield ev
        finally:
            await events.aclose()


@pytest.fixture(scope="module")
def empty_reply_server():
    engine = ChatServer(*tiny_model_and_tokenizer(seed=1), max_slots=1, model_id="tiny")
    client = TextDropped(engine, delay_s=0.0)
    for url in serve_page(engine, client):
        yield url, client


@pytest.fixture(scope="module")
def browser():
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1000,800",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def wait_for(predicate, timeout_s: float = 15.0, what: str = "condition"):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def test_type_stream_stop_regenerate(server, browser):
    from selenium.webdriver.common.by import By

    url, engine, client = server
    browser.get(url)
    el = lambda css: browser.find_element(By.CSS_SELECTOR, css)  # noqa: E731
    assistant_text = lambda: browser.execute_script(  # noqa: E731
        "const b = document.querySelectorAll('.msg.assistant'); return b.length ? b[b.length - 1].textContent : '';"
    )
    el("#temperature").clear()
    el("#temperature").send_keys("0")
    el("#top_k").clear()
    el("#top_k").send_keys("7")
    el("#input").send_keys("What is a JSON decoder?")
    el("#send").click()

    assert el(".msg.user").text == "What is a JSON decoder?"
    first = wait_for(lambda: len(assistant_text()), what="the first streamed text")
    wait_for(lambda: len(assistant_text()) > first + 5, what="the streamed text to grow")
    assert el("#stop").is_enabled() and not el("#send").is_enabled()
    assert client.requests[-1]["temperature"] == 0 and client.requests[-1]["top_k"] == 7

    el("#stop").click()
    wait_for(lambda: el("#send").is_enabled(), what="the page to leave the generating state")
    stopped = assistant_text()
    time.sleep(0.5)
    assert assistant_text() == stopped and stopped  # nothing arrives after Stop
    assert el("#status").text == "stopped"
    assert asyncio.run(engine.wait_idle(10.0)), engine.stats()  # the server freed the row
    assert engine.stats()["cancelled"] >= 1

    # regenerate the reply (replaces the stopped one) with a short limit, and let it finish
    el("#max_tokens").clear()
    el("#max_tokens").send_keys("6")
    el("#regenerate").click()
    wait_for(
        lambda: el("#status").text.startswith(("length", "stop")), what="the regenerated reply to finish"
    )
    assert el("#status").text.endswith("tokens")
    assert len(browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == 1
    sent = client.requests[-1]
    assert sent["max_tokens"] == 6 and sent["messages"] == [
        {"role": "user", "content": "What is a JSON decoder?"}
    ]
    assert asyncio.run(engine.wait_idle(10.0))


def test_calculator_call_shows_as_a_block_and_goes_back_as_history(calculator_server, browser, tmp_path):
    """The reply's call and result are a .tool block (never control-token text); the next question sends
    the reply back as an OpenAI-style history with the call's raychat record, and is answered as trained.
    A screenshot is written to $RAYCHAT_SCREENSHOT_DIR (default: the test's tmp dir)."""
    from selenium.webdriver.common.by import By

    url, client = calculator_server
    browser.get(url)
    el = lambda css: browser.find_element(By.CSS_SELECTOR, css)  # noqa: E731
    el("#temperature").clear()
    el("#temperature").send_keys("0")
    for question, expression, output in (
        ("What is 47 * 12?", "47 * 12", "564"),
        ("And 5 + 6?", "5 + 6", "11"),
    ):
        el("#input").send_keys(question)
        el("#send").click()
        wait_for(lambda: el("#status").text.startswith("stop"), what="the reply to finish")
        bubble = browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]
        block = bubble.find_element(By.CSS_SELECTOR, ".tool")
        assert block.find_element(By.CSS_SELECTOR, ".name").text == "calculator"
        assert block.find_element(By.CSS_SELECTOR, ".expression").text == expression
        assert block.find_element(By.CSS_SELECTOR, ".output").text == output
        spans = [s.text for s in bubble.find_elements(By.CSS_SELECTOR, ":scope > span:not(.tool)")]
        assert spans == ["Let me compute it. ", f"#### {output}"]  # pre-wrap keeps the space
        assert "<|" not in browser.find_element(By.ID, "messages").text
    sent = client.requests[-1]["messages"]
    assert sent[1] == {"role": "assistant", "content": [
        {"type": "text", "text": "Let me compute it. "}, {"type": "python", "text": "47 * 12"},
        {"type": "python_output", "text": "564"}, {"type": "text", "text": "#### 564"}]}  # fmt: skip
    shot = Path(os.environ.get("RAYCHAT_SCREENSHOT_DIR", tmp_path)) / "chat_calculator.png"
    assert browser.save_screenshot(str(shot))
    print(f"screenshot: {shot}")


def test_a_conversation_beyond_the_context_drops_its_oldest_exchanges(short_context_server, browser):
    """The page answered every message after the context filled with "400: prompt has N tokens" until it was
    reloaded; now, on the server's context_length_exceeded, it drops the oldest exchange, says so and asks
    again, and the conversation goes on."""
    from selenium.webdriver.common.by import By

    url, engine, client = short_context_server
    browser.get(url)
    el = lambda css: browser.find_element(By.CSS_SELECTOR, css)  # noqa: E731
    el("#temperature").clear()
    el("#temperature").send_keys("0")
    el("#max_tokens").clear()
    el("#max_tokens").send_keys("4")
    questions = [f"question {k} about the json module" for k in range(6)]
    for k, question in enumerate(questions, start=1):
        el("#input").send_keys(question)
        el("#send").click()
        wait_for(
            lambda k=k: (
                len(browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == k
                and el("#send").is_enabled()
            ),
            what=f"reply {k}",
        )
    notes = [n.text for n in browser.find_elements(By.CSS_SELECTOR, ".msg.note")]
    assert notes and all(
        n.startswith("the conversation outgrew the model's context: its oldest ") for n in notes
    )
    assert browser.find_elements(By.CSS_SELECTOR, ".msg.error") == []
    assert el("#status").text.endswith("tokens")  # the last reply finished
    sent = client.requests[-1]["messages"]
    assert sent[-1] == {"role": "user", "content": questions[-1]} and sent[0]["role"] == "user"
    assert sent[0]["content"] != questions[0]  # the first exchange was dropped
    assert engine.stats()["rejected"] >= len(notes)
    assert asyncio.run(engine.wait_idle(10.0))


def test_a_question_stopped_before_any_answer_leaves_the_page(late_server, browser):
    """A question stopped before its reply's first text is not sent again (the next question replaces it in
    the history, as two user turns in a row cannot be rendered); its bubble goes too, as does a failed
    question's with its error (they stayed on the page, which then showed a conversation other than the one
    the model was asked). A max tokens the context cannot hold is shown as the server's error, the history
    kept (the page dropped every earlier exchange, which could never make it fit)."""
    from selenium.webdriver.common.by import By

    url, client = late_server
    browser.get(url)
    el = lambda css: browser.find_element(By.CSS_SELECTOR, css)  # noqa: E731
    el("#max_tokens").clear()
    el("#max_tokens").send_keys("8")
    el("#input").send_keys("first question")
    el("#send").click()
    el("#stop").click()
    wait_for(lambda: el("#send").is_enabled(), what="the page to leave the generating state")
    assert browser.find_elements(By.CSS_SELECTOR, ".msg.assistant") == []
    el("#input").send_keys("second question")
    el("#send").click()
    wait_for(lambda: el("#status").text.endswith("tokens"), what="the second reply")
    assert [b.text for b in browser.find_elements(By.CSS_SELECTOR, ".msg.user")] == ["second question"]
    assert client.requests[-1]["messages"] == [{"role": "user", "content": "second question"}]
    assert len(browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == 1
    el("#max_tokens").clear()
    el("#max_tokens").send_keys("4096")  # more than the 256-token context holds after the question: a 400
    el("#input").send_keys("third question")
    el("#send").click()
    wait_for(lambda: el("#status").text == "error", what="the refusal")
    assert "context length" in el(".msg.error").text
    el("#max_tokens").clear()
    el("#input").send_keys("fourth question")
    el("#send").click()
    wait_for(lambda: el("#status").text.endswith("tokens"), what="the fourth reply")
    questions = [b.text for b in browser.find_elements(By.CSS_SELECTOR, ".msg.user")]
    assert questions == ["second question", "fourth question"]
    assert browser.find_elements(By.CSS_SELECTOR, ".msg.error") == []
    assert [m["content"] for m in client.requests[-1]["messages"] if m["role"] == "user"] == questions


def test_an_empty_reply_is_a_reply(empty_reply_server, browser):
    """A reply of no visible characters that ended (done) was dropped as if never answered: the next question
    replaced its question in the history. It is kept, an assistant message of content "", shown as a muted
    "(empty reply)"."""
    from selenium.webdriver.common.by import By

    url, client = empty_reply_server
    browser.get(url)
    el = lambda css: browser.find_element(By.CSS_SELECTOR, css)  # noqa: E731
    el("#max_tokens").clear()
    el("#max_tokens").send_keys("4")
    el("#input").send_keys(SILENT)
    el("#send").click()
    wait_for(lambda: el("#status").text.endswith("tokens"), what="the empty reply to end")
    assert [b.text for b in browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")] == ["(empty reply)"]
    el("#input").send_keys("next question")
    el("#send").click()
    wait_for(
        lambda: (
            len(browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == 2 and el("#send").is_enabled()
        ),
        what="the second reply",
    )
    assert [b.text for b in browser.find_elements(By.CSS_SELECTOR, ".msg.user")] == [SILENT, "next question"]
    assert client.requests[-1]["messages"] == [
        {"role": "user", "content": SILENT},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": ""}],
        },  # the page's "", as the engine reads it
        {"role": "user", "content": "next question"},
    ]
    assert browser.find_elements(By.CSS_SELECTOR, ".msg.error") == []
