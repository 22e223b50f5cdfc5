"""The chat page at GET /: served with a strict CSP, and used in a real Chromium against the real server."""
import json

import pytest

import browser
from bench import servers
from tornchat import config as config_module

KEY = "sk-page-key"
LONG = "Write a long story about a dragon who learns to cook."
HOSTILE = '<img src=x onerror="window.pwned=1"><script>window.pwned=2</script><b>not bold</b> &amp;'


# The real SmolLM2, so replies read like replies; --quantize none skips timing the decode formats at start.
FAST_START = ("--quantize", "none")


@pytest.fixture(scope="module")
def server():
    with servers.running(*FAST_START) as running:
        yield running


@pytest.fixture(scope="module")
def keyed_server():
    with servers.running(*FAST_START, "--api-key", KEY) as running:
        yield running


def metric(server, name: str, headers: dict | None = None) -> float:
    return browser.metric(server.url, name, headers)


# ---- HTTP -------------------------------------------------------------------------


def test_page_and_files_are_served_with_a_strict_policy(server):
    page = servers.request(server.url, "GET", "/")
    assert page.status == 200 and page.headers["Content-Type"].startswith("text/html")
    policy = page.headers["Content-Security-Policy"]
    assert "default-src 'none'" in policy and "script-src 'self'" in policy and "connect-src 'self'" in policy
    assert "unsafe-inline" not in policy and "http" not in policy and "*" not in policy
    html = page.body.decode()
    assert '<meta name="tornchat-auth" content="none">' in html
    assert "<script>" not in html and "http://" not in html and "https://" not in html, "nothing inline, nothing from elsewhere"
    for name, kind in (("chat.js", "text/javascript"), ("markdown.js", "text/javascript"), ("chat.css", "text/css"), ("icon.svg", "image/svg+xml")):
        asset = servers.request(server.url, "GET", "/web/" + name)
        assert asset.status == 200 and asset.headers["Content-Type"].startswith(kind), name
        assert asset.headers["Content-Security-Policy"] == policy
        if name != "icon.svg":  # the SVG names its XML namespace by URL
            assert b"innerHTML" not in asset.body and b"http://" not in asset.body, name
    assert servers.request(server.url, "GET", "/web/secret.py").status == 404
    assert servers.request(server.url, "GET", "/web/../server/web.py").status == 404


def test_page_is_open_but_the_api_is_not(keyed_server):
    page = servers.request(keyed_server.url, "GET", "/")
    assert page.status == 200 and '<meta name="tornchat-auth" content="bearer">' in page.body.decode()
    assert KEY not in page.body.decode()
    assert servers.request(keyed_server.url, "GET", "/web/chat.js").status == 200
    assert servers.request(keyed_server.url, "GET", "/v1/models").status == 401


def test_no_web_ui_turns_the_page_off(tiny_checkpoint):
    with servers.running(*FAST_START, "--checkpoint-path", tiny_checkpoint, "--no-web-ui") as off:
        assert servers.request(off.url, "GET", "/").status == 404
        assert servers.request(off.url, "GET", "/web/chat.js").status == 404
        assert "/" not in servers.request(off.url, "GET", "/openapi.json").json()["paths"]
        assert servers.request(off.url, "GET", "/v1/models").status == 200


def test_config_file_key_web_ui(tmp_path):
    path = tmp_path / "tornchat.yaml"
    path.write_text("web_ui: false\n")
    assert config_module.build(str(path), {}).web_ui is False
    assert config_module.build(None, {}).web_ui is True
    path.write_text("web_ui: 'no'\n")
    with pytest.raises(ValueError, match="web_ui"):
        config_module.build(str(path), {})


# ---- in the browser ---------------------------------------------------------------


def test_reply_streams_and_stop_cancels_on_the_server(chromium, server):
    cancelled = metric(server, "tornchat_engine_cancelled_total")
    with browser.tab(chromium, server.url) as tab:
        tab.setting("max_tokens", "400")
        tab.send(LONG)
        page = tab.page
        assert page.is_visible("#stop") and page.is_hidden("#send")
        reply = tab.reply()
        # The reply grows in place while the request is still open.
        sizes = [browser.wait_until(lambda: len(reply.inner_text()), what="first text")]
        for _ in range(3):
            sizes.append(browser.wait_until(lambda: (n := len(reply.inner_text())) > sizes[-1] and n, what="more text"))
        assert "streaming" in reply.get_attribute("class") and page.is_visible("#stop")
        # Away to a new conversation and back: the reply keeps streaming into its own place.
        page.click("#new-chat")
        assert page.locator("#messages .message").count() == 0
        page.locator("#conversations .open").nth(1).click()
        assert page.locator("#messages .message.assistant").count() == 1
        at_return = len(reply.inner_text())
        browser.wait_until(lambda: len(reply.inner_text()) > at_return, what="growth after switching back")
        page.click("#stop")
        tab.wait_idle()
        assert "finish: stopped" in reply.locator(".stats").inner_text()
        browser.wait_until(lambda: metric(server, "tornchat_engine_cancelled_total") == cancelled + 1, what="server-side cancel")
        assert metric(server, "tornchat_server_client_disconnects_total") >= 1
        stopped_at = reply.locator(".body").inner_text()
        page.wait_for_timeout(300)
        assert reply.locator(".body").inner_text() == stopped_at, "nothing arrives after Stop"
        assert tab.errors == []


def test_reply_figures_and_edit_resend_reuses_the_cache(chromium, server):
    with browser.tab(chromium, server.url) as tab:
        tab.setting("system", "You are a terse assistant.")
        tab.setting("temperature", "0")
        tab.setting("max_tokens", "12")
        tab.send("Name three colours.")
        tab.wait_idle()
        stats = tab.reply().locator(".stats")
        assert "finish: " in stats.inner_text()
        ttft = stats.locator(".ttft").inner_text()
        assert ttft.startswith("TTFT ") and ttft.endswith(" ms")
        assert stats.locator(".speed").inner_text().endswith(" tokens/s")
        assert stats.locator(".completion").inner_text() == "12 tokens"
        assert stats.locator(".finish").inner_text() == "finish: length"
        first_prompt = stats.locator(".prompt").inner_text()
        assert first_prompt.startswith("prompt ") and first_prompt.endswith(" cached)")

        # Edit the first message and resend: the shared prefix (system prompt) comes from the KV cache.
        page = tab.page
        page.click("#messages .message.user .edit")
        page.fill("#messages .edit-field", "Name three animals.")
        page.click("#messages .resend")
        tab.wait_idle()
        assert page.locator("#messages .message").count() == 2, "the old reply is replaced"
        assert page.inner_text("#messages .message.user .plain") == "Name three animals."
        prompt = page.inner_text("#messages .message.assistant .stats .prompt")
        cached = int(prompt.split("(")[1].split()[0])
        assert cached > 0, prompt
        # The conversation, reply and figures included, survives a reload.
        page.reload()
        assert page.inner_text("#messages .message.user .plain") == "Name three animals."
        assert page.inner_text("#messages .message.assistant .stats .prompt") == prompt
        assert tab.errors == []


def test_markup_in_messages_and_replies_is_text(chromium, server):
    stored = [{
        "id": "stored", "title": "Earlier <b>chat</b>",
        "messages": [
            {"role": "user", "content": "show me"},
            {"role": "assistant", "content": f"**bold** and `{HOSTILE}`\n\n- one *item*\n- two\n\n```html\n{HOSTILE}\n```\n\n{HOSTILE}\n\n"
                        "## See [the docs](https://example.com/a) or [this](javascript:window.pwned=3)",
             "stats": {"finish_reason": "stop"}},
        ],
    }]
    with browser.tab(chromium, server.url) as tab:
        page = tab.page
        page.evaluate("([c]) => { localStorage.setItem('tornchat.conversations', c); localStorage.setItem('tornchat.current', '\"stored\"'); }",
                      [json.dumps(stored)])
        page.reload()
        reply = tab.reply()
        assert reply.locator("strong").inner_text() == "bold"
        assert reply.locator("li").all_inner_texts() == ["one item", "two"]
        assert reply.locator("li em").inner_text() == "item"
        assert reply.locator("pre code").inner_text() == HOSTILE
        assert reply.locator("p code").inner_text() == HOSTILE
        assert HOSTILE in reply.locator("p").last.inner_text()
        assert page.inner_text("#conversations li.current .open") == "Earlier <b>chat</b>"
        heading = reply.locator("h4")
        assert heading.locator("a").count() == 1, "only http(s) links become links"
        assert heading.locator("a").get_attribute("href") == "https://example.com/a"
        assert "[this](javascript:window.pwned=3)" in heading.inner_text()

        tab.setting("max_tokens", "4")
        tab.send(HOSTILE)
        tab.wait_idle()
        assert page.locator("#messages .message.user .plain").last.inner_text() == HOSTILE
        assert page.locator("#messages img, #messages script, #messages b, #conversations b").count() == 0
        assert page.evaluate("window.pwned") is None
        assert tab.errors == []


def test_conversations_new_rename_delete(chromium, server):
    with browser.tab(chromium, server.url) as tab:
        page = tab.page
        tab.setting("max_tokens", "3")
        tab.send("First conversation")
        tab.wait_idle()
        page.click("#new-chat")
        assert page.locator("#messages .message").count() == 0
        tab.send("Second conversation")
        tab.wait_idle()
        titles = page.locator("#conversations .open")
        assert titles.all_inner_texts() == ["Second conversation", "First conversation"]

        other = page.locator("#conversations li").nth(1)
        other.hover()  # Rename and Delete show on the current conversation and under the pointer
        other.locator(".rename").click()
        page.fill("#conversations .rename-field", "Renamed")
        page.press("#conversations .rename-field", "Enter")
        page.reload()
        assert titles.all_inner_texts() == ["Second conversation", "Renamed"]
        page.locator("#conversations .open").nth(1).click()
        assert page.inner_text("#title") == "Renamed"
        assert page.inner_text("#messages .message.user .plain") == "First conversation"

        page.locator("#conversations li.current .delete").click()
        assert titles.all_inner_texts() == ["Second conversation"]
        assert page.inner_text("#messages .message.user .plain") == "Second conversation"
        page.reload()
        assert titles.all_inner_texts() == ["Second conversation"]
        assert tab.errors == []


def test_tool_calls_show_as_calls(chromium, server):
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    with browser.tab(chromium, server.url) as tab:
        tab.setting("tools", json.dumps([weather]))
        tab.setting("tool_choice", "get_weather")
        tab.setting("temperature", "0")
        tab.setting("max_tokens", "24")
        tab.send("What is the weather in Paris?")
        tab.wait_idle()
        call = tab.reply().locator(".call")
        assert call.locator(".call-name").inner_text() == "get_weather"
        assert "city" in call.locator(".call-arguments").inner_text()
        assert tab.reply().locator(".finish").inner_text() in ("finish: tool_calls", "finish: length")
        # A bad tools box is named, and nothing is sent.
        tab.setting("tools", "[not json")
        assert "Tools is not valid JSON" in tab.page.inner_text("#settings-error")
        assert tab.errors == []


def test_page_with_api_key(chromium, keyed_server, tmp_path):
    with browser.tab(chromium, keyed_server.url) as tab:
        page = tab.page
        page.wait_for_selector("#key-dialog[open]")
        page.fill("#key-input", KEY)
        page.press("#key-input", "Enter")
        assert not page.is_visible("#key-dialog")
        tab.setting("temperature", "0")
        tab.setting("max_tokens", "48")
        tab.send("List three fruits as a markdown list.")
        tab.wait_idle()
        assert tab.reply().locator(".reply-error").count() == 0
        assert "finish: " in tab.reply().locator(".stats").inner_text() and tab.reply().locator(".body").inner_text()
        assert page.evaluate("sessionStorage.getItem('tornchat.credential')") == KEY
        stored = page.evaluate("JSON.stringify(Object.assign({}, localStorage))")
        assert KEY not in stored, "the key stays in sessionStorage"
        tab.setting("max_tokens", "24")
        tab.send("Which one is yellow?")
        tab.wait_idle()
        prompt = tab.reply().locator(".prompt").inner_text()
        assert int(prompt.split("(")[1].split()[0]) > 0, "the second turn starts from the first one's KV cache"
        browser.screenshot(tab, tmp_path, "web-ui.png")
        assert tab.errors == []

    with browser.tab(chromium, keyed_server.url) as tab:
        page = tab.page
        page.fill("#key-input", "wrong-key")
        page.click("#key-save")
        tab.send("Hello")
        page.wait_for_selector("#key-dialog[open]")
        assert "refused" in page.inner_text("#key-prompt")
        assert "401" in tab.reply().locator(".reply-error").inner_text()
        assert page.evaluate("sessionStorage.getItem('tornchat.credential')") is None
        assert all("401" in error for error in tab.errors), tab.errors


def test_page_with_basic_credentials(chromium, tiny_checkpoint):
    login = "ana:pä ss:word"  # not Latin-1, and a colon in the password
    with servers.running(*FAST_START, "--checkpoint-path", tiny_checkpoint, "--api-auth", login) as server:
        with browser.tab(chromium, server.url) as tab:
            page = tab.page
            page.wait_for_selector("#key-dialog[open]")
            assert "user:password" in page.inner_text("#key-prompt")
            page.fill("#key-input", login)
            page.press("#key-input", "Enter")
            tab.setting("max_tokens", "4")
            tab.send("Hello")
            tab.wait_idle()
            assert tab.reply().locator(".finish").inner_text() == "finish: length"
            assert tab.errors == []

        # A refused login comes back to the page's own dialog, not the browser's password prompt.
        with browser.tab(chromium, server.url) as tab:
            page = tab.page
            page.fill("#key-input", "ana:wrong")
            page.press("#key-input", "Enter")
            tab.send("Hello")
            page.wait_for_selector("#key-dialog[open]", timeout=20_000)
            assert "refused" in page.inner_text("#key-prompt")
            assert all("401" in error for error in tab.errors), tab.errors
