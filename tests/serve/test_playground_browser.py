"""The playground in a real browser: headless Chromium (Debian's `chromium`, driven by
Playwright) against real `deepwell serve` processes on loopback.

Each test keeps a screenshot of its view under test-artifacts/playground/.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import threading
import time

import httpx
import pytest
import uvicorn
from PIL import Image
from servers import REPO, free_port, start_server

from deepwell.recipe import InferenceChunk, InferenceFinishReason
from deepwell.serve.api import create_app

playwright = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')"
)

ARTIFACTS = REPO / "test-artifacts" / "playground"
# The distribution's browser: Playwright never downloads one here.
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
TIMEOUT_MS = 60_000


def _browser_path() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


@pytest.fixture(scope="module")
def browser():
    path = _browser_path()
    if path is None:
        pytest.skip(
            f"no Chromium found (looked for {', '.join(BROWSERS)}): apt-get install chromium"
        )
    with playwright.sync_playwright() as driver:
        launched = driver.chromium.launch(executable_path=path, headless=True)
        yield launched
        launched.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    opened = context.new_page()
    opened.set_default_timeout(TIMEOUT_MS)
    # Anything the page asks of another host would mean a CDN or a leak: refuse and record it.
    outside: list[str] = []

    def guard(route):
        url = route.request.url
        if url.startswith("http://127.0.0.1:"):
            route.continue_()
        else:
            outside.append(url)
            route.abort()

    opened.route("**/*", guard)
    yield opened
    context.close()
    assert not outside, f"the page fetched from outside the server: {outside}"


def screenshot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def open_playground(page, base_url: str, view: str) -> None:
    page.goto(f"{base_url}/playground")
    page.wait_for_function("document.querySelector('#model').options.length > 0")
    page.click(f"#tab-{view}")


def page_segments(page) -> list[dict]:
    return page.eval_on_selector_all(
        "#prompt .seg",
        "nodes => nodes.map(n => ({text: n.textContent, special: n.dataset.special === 'true',"
        " ids: n.dataset.ids === undefined ? null : n.dataset.ids.split(',').map(Number)}))",
    )


# A control spelling the user typed, for each server's encoding: DeepSeek's (mock) and
# ChatML's (the embedded SmolLM2).
TYPED = {"mock": "<｜User｜>", "model": "<|im_start|>"}


@pytest.mark.parametrize("kind", ["mock", "model"])
def test_prompt_view_highlights_control_tokens_and_ids_as_the_server_tokenizes(kind, request, page):
    server = request.getfixturevalue(f"{kind}_server")
    typed = f"Is {TYPED[kind]} a turn? No, I typed it."
    body = {"model": server.model, "messages": [{"role": "user", "content": typed}]}
    open_playground(page, server.base_url, "prompt")
    page.fill("#request", json.dumps(body, ensure_ascii=False))
    page.click("#render")
    page.wait_for_selector("#prompt .seg")
    screenshot(page, f"prompt-{kind}")

    shown = page_segments(page)
    expected = httpx.post(f"{server.base_url}/v1/render", content=json.dumps(body)).json()
    assert [(s["text"], s["special"], s["ids"]) for s in shown] == [
        (s["text"], s["special"], s["token_ids"]) for s in expected["segments"]
    ]
    highlighted = page.eval_on_selector_all(
        "#prompt .seg.special", "ns => ns.map(n => n.textContent)"
    )
    assert [expected["prompt"][a:b] for a, b in expected["special_ranges"]] == highlighted
    # The typed spelling sits inside a plain segment, not in a highlighted one.
    typed_segment = next(s for s in shown if typed in s["text"])
    assert not typed_segment["special"]
    assert page.locator("#prompt .seg.plain", has_text=typed).count() == 1
    if kind == "model":
        # The ids beside the segments are the prompt the server runs: a real request counts
        # exactly as many prompt tokens, and the typed spelling is not its control id.
        ids = [i for s in shown for i in s["ids"]]
        assert ids == expected["token_ids"]
        reply = httpx.post(
            f"{server.base_url}/v1/chat/completions",
            json={**body, "max_tokens": 1, "temperature": 0},
            timeout=120,
        ).json()
        assert reply["usage"]["prompt_tokens"] == len(ids)
        control = next(s["ids"] for s in shown if s["special"] and s["text"] == TYPED[kind])
        assert control[0] not in typed_segment["ids"]
    else:
        assert "no ids" in page.inner_text("#prompt-meta")


def test_output_view_shows_each_dialects_chunks_and_the_accumulated_response(mock_server, page):
    body = {"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": "2+2?"}]}
    open_playground(page, mock_server.base_url, "output")
    page.fill("#request", json.dumps(body, ensure_ascii=False))
    page.fill("#output-text", "Add them.</think>2 + 2 = 4.")
    page.click("#replay")
    page.wait_for_function("document.querySelector('#replay-messages .response').textContent")
    screenshot(page, "output-mock")

    expected = httpx.post(
        f"{mock_server.base_url}/v1/replay",
        json={"request": body, "output": "Add them.</think>2 + 2 = 4."},
    ).json()
    for replay in expected["dialects"]:
        column = f"#replay-{replay['dialect']}"
        shown = page.eval_on_selector_all(
            f"{column} .frames .data", "ns => ns.map(n => n.textContent)"
        )
        # Same frames in the same order (ids and timestamps differ between the two calls).
        assert len(shown) == len(replay["frames"])
        items = page.eval_on_selector_all(
            f"{column} .frames li", "ns => ns.map(n => n.textContent)"
        )
        assert all(
            item.startswith(f"event: {frame['event']} ")
            for item, frame in zip(items, replay["frames"], strict=True)
            if frame["event"]
        )
    chat = json.loads(page.inner_text("#replay-chat .response"))
    message = chat["choices"][0]["message"]
    assert message["reasoning_content"] == "Add them." and message["content"] == "2 + 2 = 4."
    messages = json.loads(page.inner_text("#replay-messages .response"))
    assert [b["type"] for b in messages["content"]] == ["thinking", "text"]
    assert page.locator("#pieces .piece.sent").count() == len(expected["pieces"])


def count_updates(page) -> None:
    """Count, per part of an assistant turn (reasoning, content, tool-calls), how often it
    changes while the reply streams: once per delta, not once at the end."""
    page.evaluate(
        """() => {
        window.updates = {};
        new MutationObserver((records) => {
            for (const record of records) {
                const target = record.target;
                if (target.parentElement && target.parentElement.classList.contains('assistant')) {
                    window.updates[target.className] = (window.updates[target.className] || 0) + 1;
                }
            }
        }).observe(document.querySelector('#chat-log'), {subtree: true, childList: true});
    }"""
    )


def send_chat(page, text: str) -> dict:
    page.fill("#chat-input", text)
    page.click("#chat-send")
    page.wait_for_selector(".turn.assistant .finish:has-text('finish:')")
    turn = page.locator(".turn.assistant").last
    return {
        "reasoning": turn.locator(".reasoning").inner_text(),
        "content": turn.locator(".content").inner_text(),
        "tool_calls": turn.locator(".tool-calls").inner_text(),
        "finish": turn.locator(".finish").inner_text(),
    }


def test_chat_view_streams_the_mock_reply(mock_server, page):
    open_playground(page, mock_server.base_url, "chat")
    shown = send_chat(page, "Hi")
    screenshot(page, "chat-mock")
    assert shown["content"] == "Hello world!" and "finish: stop" in shown["finish"]


def test_chat_view_sends_an_attached_image_as_an_image_url_data_url(mock_server, page, tmp_path):
    image = tmp_path / "cat.png"
    Image.new("RGB", (40, 30), (200, 40, 40)).save(image)
    open_playground(page, mock_server.base_url, "chat")
    # The mock's V4.1-Flash reads and checks images (V4-Pro would not see them).
    page.select_option("#model", "DeepSeek-V4.1-Flash")
    sent = []
    page.on(
        "request",
        lambda request: (
            sent.append(request.post_data_json)
            if request.url.endswith("/v1/chat/completions")
            else None
        ),
    )
    page.set_input_files("#chat-image", str(image))
    shown = send_chat(page, "What is this?")
    screenshot(page, "chat-image")
    assert shown["content"] == "Hello world!"
    text, part = sent[0]["messages"][0]["content"]
    assert text == {"type": "text", "text": "What is this?"}
    expected = "data:image/png;base64," + base64.b64encode(image.read_bytes()).decode()
    assert part == {"type": "image_url", "image_url": {"url": expected}}
    assert page.locator(".turn.user img.attached").count() == 1
    # The attachment goes with one message only.
    send_chat(page, "And now?")
    assert sent[1]["messages"][-1]["content"] == "And now?"


def test_chat_view_streams_the_embedded_models_greedy_reply(model_server, page):
    open_playground(page, model_server.base_url, "chat")
    page.fill("#chat-temperature", "0")
    page.fill("#chat-max-tokens", "24")
    count_updates(page)
    shown = send_chat(page, "What is the capital of France?")
    screenshot(page, "chat-model")
    reply = httpx.post(
        f"{model_server.base_url}/v1/chat/completions",
        json={
            "model": model_server.model,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 24,
            "temperature": 0,
            "thinking": {"type": "disabled"},
        },
        timeout=120,
    ).json()
    assert shown["content"] == reply["choices"][0]["message"]["content"].strip() != ""
    # The answer grew delta by delta, not in one final update.
    assert page.evaluate("window.updates")["content"] >= 3


# The DSML block of a V4.1 tool call (deepwell/recipe/encoding/deepseek.py).
TOOL_CALL = (
    '\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="add">\n'
    '<｜DSML｜ parameter name="a" string="false">2</｜DSML｜ parameter>\n'
    "</｜DSML｜ invoke>\n</｜DSML｜ calls>"
)
SCRIPT = ["Two ", "numbers.", "</think>", "Let me ", "add.", TOOL_CALL]


async def scripted(request):
    """A model that thinks, answers and calls a tool, a piece every 50 ms."""
    yield InferenceChunk.ready()
    for piece in SCRIPT:
        yield InferenceChunk.text(piece, 1)
        await asyncio.sleep(0.05)
    yield InferenceChunk.finish(InferenceFinishReason.Stop)


@pytest.fixture(scope="module")
def scripted_server():
    """The HTTP app over the scripted source, served by uvicorn on loopback in a thread."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_app(infer=scripted), host="127.0.0.1", port=port, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_chat_view_shows_reasoning_content_and_tool_calls_as_they_stream(scripted_server, page):
    open_playground(page, scripted_server, "chat")
    page.select_option("#model", "DeepSeek-V4.1-Flash")
    page.check("#chat-thinking")
    page.click("#view-chat summary")
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
            },
        }
    ]
    page.fill("#chat-tools", json.dumps(tools))
    count_updates(page)
    shown = send_chat(page, "Add 2.")
    screenshot(page, "chat-tools")
    assert shown["reasoning"] == "Two numbers."
    assert shown["content"] == "Let me add."
    assert shown["tool_calls"] == 'add({"a": 2})'
    assert "finish: tool_calls" in shown["finish"]
    updates = page.evaluate("window.updates")
    assert updates["reasoning"] == 2 and updates["content"] == 2 and updates["tool-calls"] >= 1


def test_the_page_sends_the_key_typed_into_it(tmp_path, page):
    server = start_server(tmp_path, "--mock", "--api-key", "sekrit")
    try:
        page.goto(f"{server.base_url}/playground")
        page.wait_for_selector("#status:has-text('401')")
        page.fill("#api-key", "sekrit")
        page.dispatch_event("#api-key", "change")
        page.wait_for_function("document.querySelector('#model').options.length > 0")
        page.click("#render")
        page.wait_for_selector("#prompt .seg.special")
        assert page.locator("#request-error").is_hidden()
    finally:
        assert server.stop() == 0
