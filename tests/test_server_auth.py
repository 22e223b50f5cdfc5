"""Authentication (Bearer key, HTTP Basic) and CORS, against the real server process."""
import base64

import openai
import pytest

from bench import servers
from tornchat import MODEL_ID

KEY = "sk-test-key"
USER, PASSWORD = "alice", "s3cret:with colon"
ORIGIN = "https://app.example"


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@pytest.fixture(scope="module")
def server():
    flags = ("--api-key", KEY, "--api-auth", f"{USER}:{PASSWORD}", "--cors-origin", ORIGIN)
    with servers.running(*flags) as running:
        yield running


def test_health_needs_no_credentials(server):
    assert server.health()["model_loaded"] is True


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "Bearer wrong-key",
        "Bearer " + KEY + "x",
        "bearer",
        basic(USER, "nope"),
        basic("bob", PASSWORD),
        "Basic !!!not-base64!!!",
        "Token " + KEY,
    ],
)
def test_bad_credentials_are_401_with_a_challenge(server, authorization):
    headers = {"Authorization": authorization} if authorization else {}
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
        reply = servers.request(server.url, method, path, b"{not json", headers)
        assert reply.status == 401, "credentials are checked before the body"
        assert reply.json() == {"detail": "Invalid or missing credentials"}
        challenges = reply.headers.get_all("WWW-Authenticate")
        assert any(c.startswith("Bearer") for c in challenges) and any(c.startswith("Basic") for c in challenges)
        assert reply.headers["Access-Control-Allow-Origin"] == ORIGIN


def test_sdk_raises_authentication_error(server):
    client = openai.OpenAI(base_url=server.api_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        client.models.list()
    assert caught.value.status_code == 401


def test_right_credentials_pass(server):
    client = openai.OpenAI(base_url=server.api_url, api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL_ID]
    reply = servers.request(server.url, "GET", "/v1/models", headers={"Authorization": basic(USER, PASSWORD)})
    assert reply.status == 200 and reply.headers["Access-Control-Allow-Origin"] == ORIGIN
    # Authorized, the request reaches validation.
    bad = servers.request(server.url, "POST", "/v1/chat/completions", b"[]", {"Authorization": "Bearer " + KEY})
    assert bad.status == 400


def test_cors_preflight(server):
    reply = servers.request(
        server.url,
        "OPTIONS",
        "/v1/chat/completions",
        headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"},
    )
    assert reply.status == 204
    assert reply.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in reply.headers["Access-Control-Allow-Methods"]
    assert reply.headers["Access-Control-Allow-Headers"] == "authorization, content-type"
