"""Access: the API key on every route but /health (a header, or the browser's subprotocol form),
the browser origins allowed, /docs only when asked for, and what the server says without a key."""

from __future__ import annotations

import json

import httpx
import pytest
import websockets
from servekit import ROOMY, run, running

from cadence_fx import cli
from cadence_fx.serve import app as serve_app
from cadence_fx.serve.access import Access

KEY = "sk-test-0123456789"
FOREIGN = "https://evil.example"


@pytest.fixture(scope="module")
def keyed():
    with running(ROOMY, Access(api_key=KEY, allowed_origins=("https://app.example",))) as srv:
        yield srv


async def _handshake(server, path: str = "/v1/duplex", **options) -> tuple[int, dict | None]:
    """(HTTP status of the handshake, the first event if it opened)."""
    try:
        ws = await websockets.connect(server.handle.ws_url + path, open_timeout=5, **options)
    except websockets.InvalidStatus as refused:
        return refused.response.status_code, json.loads(refused.response.body)
    first = json.loads(await ws.recv())
    await ws.close()
    return 101, first


def test_http_routes_ask_for_the_key_except_health(keyed):
    with httpx.Client(base_url=keyed.handle.http_url) as http:
        bare = http.get("/v1/models")
        wrong = http.get("/v1/models", headers={"Authorization": "Bearer sk-wrong"})
        right = http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
        health = http.get("/health")
    refusal = {
        "error": {
            "type": "invalid_request_error",
            "code": "invalid_api_key",
            "message": "a valid API key is required (Authorization: Bearer KEY)",
        }
    }
    assert (bare.status_code, bare.json(), bare.headers["www-authenticate"]) == (401, refusal, "Bearer")
    assert (wrong.status_code, wrong.json()) == (401, refusal)
    assert right.status_code == 200 and right.json()["data"][0]["id"] == "tone"
    assert (health.status_code, health.json()["status"]) == (200, "ok")


def test_the_browser_page_loads_without_the_key_and_what_it_calls_asks_for_it(keyed):
    with httpx.Client(base_url=keyed.handle.http_url) as http:
        page, script = http.get("/"), http.get("/static/app.js")
        models = http.get("/v1/models")
    assert (page.status_code, script.status_code, models.status_code) == (200, 200, 401)
    assert 'id="key"' in page.text and "openai-insecure-api-key." in script.text


def test_a_socket_opens_with_the_key_in_a_header_or_the_browser_subprotocol(keyed):
    async def scenario():
        return [
            await _handshake(keyed),
            await _handshake(keyed, additional_headers={"Authorization": "Bearer sk-wrong"}),
            await _handshake(keyed, additional_headers={"Authorization": f"Bearer {KEY}"}),
            await _handshake(keyed, "/v1/realtime", subprotocols=["realtime", f"openai-insecure-api-key.{KEY}"]),
            await _handshake(keyed, subprotocols=["realtime", "openai-insecure-api-key.sk-wrong"]),
        ]

    bare, wrong, header, subprotocol, wrong_subprotocol = run(scenario())
    assert [bare[0], wrong[0], wrong_subprotocol[0]] == [401, 401, 401]
    assert bare[1]["error"]["code"] == "invalid_api_key"
    assert header[0] == subprotocol[0] == 101
    assert header[1]["type"] == subprotocol[1]["type"] == "session.created"


def test_browser_origins_other_than_the_servers_own_and_the_allowed_are_refused(keyed):
    own = keyed.handle.http_url
    auth = {"Authorization": f"Bearer {KEY}"}

    async def scenario():
        return [
            await _handshake(keyed, additional_headers=auth, origin=FOREIGN),
            await _handshake(keyed, additional_headers=auth, origin=own),
            await _handshake(keyed, additional_headers=auth, origin="https://app.example"),
        ]

    foreign, same, allowed = run(scenario())
    with httpx.Client(base_url=own) as http:
        foreign_http = http.get("/v1/models", headers={**auth, "Origin": FOREIGN})
    message = "origin 'https://evil.example' is not allowed"
    refusal = {"error": {"type": "invalid_request_error", "code": "origin_not_allowed", "message": message}}
    assert foreign == (403, refusal)
    assert (foreign_http.status_code, foreign_http.json()["error"]["message"]) == (403, message)
    assert same[0] == allowed[0] == 101


def test_docs_are_off_unless_asked_for():
    def fetch(access: Access) -> list[int]:
        with running(ROOMY, access) as server, httpx.Client(base_url=server.handle.http_url) as http:
            return [http.get(path).status_code for path in ("/docs", "/openapi.json", "/redoc")]

    assert fetch(Access()) == [404, 404, 404]
    assert fetch(Access(docs=True)) == [200, 200, 200]


def test_without_a_key_the_server_says_it_is_open(monkeypatch, capsys):
    monkeypatch.setattr(serve_app.Server, "run", lambda self: None)  # start-up only, no serving
    serve_app.run_server("127.0.0.1", 8123, "tone")
    open_notice = capsys.readouterr().err
    serve_app.run_server("127.0.0.1", 8123, "tone", access=Access(api_key=KEY))
    keyed_notice = capsys.readouterr().err
    assert open_notice == (
        "cadence-fx serve: no API key (--api-key or CADENCE_FX_API_KEY): the service on 127.0.0.1:8123 "
        "is open to anyone who can reach that address\n"
    )
    assert keyed_notice == ""


def test_serve_takes_its_key_from_the_flag_or_the_environment(monkeypatch):
    calls = []
    monkeypatch.setattr(serve_app, "run_server", lambda *args, **kwargs: calls.append(args[:5]))
    monkeypatch.setenv("CADENCE_FX_API_KEY", "from-env")
    assert cli.main(["serve"]) == 0
    assert cli.main(["serve", "--api-key", "from-flag", "--allow-origin", "https://a.example", "--docs"]) == 0
    monkeypatch.delenv("CADENCE_FX_API_KEY")
    assert cli.main(["serve", "--max-sessions-per-client", "2"]) == 0
    (host, port, model, limits, env), (_, _, _, _, flag), (_, _, _, per_client, bare) = calls
    assert (host, port, model, limits.max_sessions_per_client) == ("127.0.0.1", 8000, "moshi-tiny", 4)
    assert env == Access(api_key="from-env")
    assert flag == Access(api_key="from-flag", allowed_origins=("https://a.example",), docs=True)
    assert (bare, per_client.max_sessions_per_client) == (Access(), 2)


def test_an_empty_key_is_refused(monkeypatch, capsys):
    monkeypatch.setenv("CADENCE_FX_API_KEY", "")
    assert cli.main(["serve"]) == 2
    assert "error: the API key must not be empty (leave it unset for an open service)" in capsys.readouterr().err
