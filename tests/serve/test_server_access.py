"""Access: the API key on every route but /health (a header, or the browser's subprotocol form),
the browser origins allowed, /docs only when asked for, and what the server says without a key."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
import websockets
from servekit import ROOMY, run, running

from cadence_fx import cli
from cadence_fx.serve import app as serve_app
from cadence_fx.serve.access import Access
from cadence_fx.serve.app import background_server
from cadence_fx.serve.plugins import ToneModel
from cadence_fx.serve.session import Limits

KEY = "sk-test-0123456789"
FOREIGN = "https://evil.example"


@pytest.fixture(scope="module")
def keyed():
    with running(ROOMY, Access(api_key=KEY, allowed_origins=("https://app.example",))) as srv:
        yield srv


async def _handshake(server, path: str = "/v1/duplex", host: str | None = None, **options) -> tuple[int, dict | None]:
    """(HTTP status of the handshake, the first event if it opened). ``host``: the name the
    client asks for (its Host header), as a browser whose DNS answer for it was rebound to the
    server's loopback address would; the socket goes to the server all the same."""
    url = server.handle.ws_url + path
    if host is not None:
        url = f"ws://{host}:{server.handle.port}{path}"
        sock = socket.create_connection(("127.0.0.1", server.handle.port))
        sock.setblocking(False)
        options["sock"] = sock
    try:
        ws = await websockets.connect(url, open_timeout=5, **options)
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


# ---------------------------------------------------------------- issue 41: who the server answers to


def _refused_host(name: str) -> dict:
    message = (
        f"host '{name}' is not allowed: this server answers only to its own address, localhost, 127.0.0.1, "
        f"::1 and the names given with --allowed-host; to allow this one, start it with --allowed-host '{name}'"
    )
    return {"error": {"type": "invalid_request_error", "code": "host_not_allowed", "message": message}}


def test_a_rebound_host_is_refused_even_on_an_open_server():
    """DNS rebinding: a page of evil.example whose name now points at 127.0.0.1 opens a socket
    to it; its Origin matches its Host, so the Host itself must be one the server answers to."""
    with running(ROOMY) as server:  # no key
        port = server.handle.port
        rebound = run(_handshake(server, host="evil.example", origin=f"http://evil.example:{port}"))
        own = run(_handshake(server, host="localhost", origin=f"http://localhost:{port}"))
        with httpx.Client(base_url=server.handle.http_url) as http:
            answers = {
                host: [http.get(path, headers={"Host": host}) for path in ("/v1/models", "/health", "/")]
                for host in (
                    f"evil.example:{port}",
                    "EVIL.example",
                    f"localhost:{port}",
                    f"127.0.0.1:{port}",
                    f"[::1]:{port}",
                    "localhost.",
                )
            }
    assert rebound == (421, _refused_host("evil.example"))
    assert (own[0], own[1]["type"]) == (101, "session.created")
    assert {host: [a.status_code for a in got] for host, got in answers.items()} == {
        f"evil.example:{port}": [421, 421, 421],
        "EVIL.example": [421, 421, 421],
        f"localhost:{port}": [200, 200, 200],
        f"127.0.0.1:{port}": [200, 200, 200],
        f"[::1]:{port}": [200, 200, 200],
        "localhost.": [200, 200, 200],
    }
    assert answers["EVIL.example"][1].json() == _refused_host("evil.example")


def test_allowed_hosts_are_served_besides_the_servers_own():
    with running(ROOMY, Access(allowed_hosts=("voice.example", "[2001:db8::1]"))) as server:
        port = server.handle.port
        named = run(_handshake(server, host="voice.example", origin=f"https://voice.example:{port}"))
        other = run(_handshake(server, host="evil.example"))
        with httpx.Client(base_url=server.handle.http_url) as http:
            v6 = http.get("/health", headers={"Host": f"[2001:db8::1]:{port}"}).status_code
    assert (named[0], named[1]["type"], other[0], v6) == (101, "session.created", 421, 200)


def test_a_server_on_every_interface_answers_to_the_address_each_connection_came_in_on():
    with background_server(ToneModel, ROOMY, host="0.0.0.0") as handle:
        with httpx.Client() as http:

            def status(host: str) -> int:  # every request goes to 127.0.0.2, a loopback address not named so
                return http.get(f"http://127.0.0.2:{handle.port}/health", headers={"Host": host}).status_code

            answers = [status(f"127.0.0.2:{handle.port}"), status("127.0.0.3"), status("evil.example")]
    assert answers == [200, 421, 421]


def test_a_server_answers_to_the_name_it_was_started_on():
    assert Access().serving("voice.lan") == Access(allowed_hosts=("voice.lan",))
    assert Access(allowed_hosts=("voice.lan",)).serving("Voice.LAN") == Access(allowed_hosts=("voice.lan",))
    assert [Access().serving(host) for host in ("0.0.0.0", "::", "127.0.0.1", "localhost")] == [Access()] * 4


@pytest.mark.parametrize(
    ("hosts", "sentence"),
    [
        (
            ("https://voice.example",),
            "allowed host 'https://voice.example' must be a host name or address, "
            "without a scheme, port or path (voice.example, 10.0.0.5, ::1), or '*'",
        ),
        (
            ("voice.example:8443",),
            "allowed host 'voice.example:8443' must be a host name or address, "
            "without a scheme, port or path (voice.example, 10.0.0.5, ::1), or '*'",
        ),
        (
            ("",),
            "allowed host '' must be a host name or address, without a scheme, port or path "
            "(voice.example, 10.0.0.5, ::1), or '*'",
        ),
    ],
)
def test_an_allowed_host_that_is_not_a_host_name_is_refused(hosts, sentence):
    with pytest.raises(ValueError) as info:
        Access(allowed_hosts=hosts)
    assert str(info.value) == sentence


def _clients(server, forwarded: list[str]) -> list[tuple[str, str]]:
    """Opens one socket for each X-Forwarded-For value in turn: (first event's type, its error
    message or its session's client) each."""

    async def scenario():
        out, open_ = [], []
        for value in forwarded:
            ws = await websockets.connect(server.handle.ws_url + "/v1/duplex", additional_headers={"X-Forwarded-For": value})
            first = json.loads(await ws.recv())
            if first["type"] == "session.created":
                client = server.on_loop(lambda: server.session(first["session"]["id"]).client)
                out.append(("session.created", client))
                open_.append(ws)
            else:
                out.append((first["error"]["code"], first["error"]["message"]))
                await ws.close()
        for ws in open_:
            await ws.close()
        return out

    return run(scenario())


def test_x_forwarded_for_is_ignored_unless_its_proxy_is_trusted():
    """Issue 41: uvicorn trusted X-Forwarded-For from 127.0.0.1 by default, so one local client
    naming a new address in each connection got a session each, past max_sessions_per_client."""
    limits = Limits(max_sessions=64, max_sessions_per_client=2)
    forwarded = ["203.0.113.1", "203.0.113.2", "203.0.113.3"]
    with running(limits) as server:
        untrusted = _clients(server, forwarded)
    with running(limits, Access(trusted_proxies=("127.0.0.1",))) as server:
        trusted = _clients(server, forwarded + ["203.0.113.1", "203.0.113.1"])
    full = "this client ('{}') holds 2 sessions, max_sessions_per_client=2"
    assert untrusted == [
        ("session.created", "127.0.0.1"),
        ("session.created", "127.0.0.1"),
        ("resource_exhausted", full.format("127.0.0.1")),
    ]
    assert trusted == [
        ("session.created", "203.0.113.1"),
        ("session.created", "203.0.113.2"),
        ("session.created", "203.0.113.3"),
        ("session.created", "203.0.113.1"),
        ("resource_exhausted", full.format("203.0.113.1")),
    ]


@pytest.mark.parametrize(
    ("proxies", "sentence"),
    [
        (("10.0.0.1/8",), "trusted proxy '10.0.0.1/8' must be an IP address (10.0.0.5), a network (10.0.0.0/8) or '*'"),
        (("proxy.example",), "trusted proxy 'proxy.example' must be an IP address (10.0.0.5), a network (10.0.0.0/8) or '*'"),
    ],
)
def test_a_trusted_proxy_that_is_not_an_address_is_refused(proxies, sentence):
    with pytest.raises(ValueError) as info:
        Access(trusted_proxies=proxies)
    assert str(info.value) == sentence


def test_serve_passes_allowed_hosts_and_trusted_proxies(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(serve_app, "run_server", lambda *args, **kwargs: calls.append(args[4]))
    options = [
        "--allowed-host",
        "voice.example",
        "--allowed-host",
        "10.0.0.5",
        "--trusted-proxy",
        "10.0.0.0/8",
        "--trusted-proxy",
        "192.0.2.7",
    ]
    assert cli.main(["serve", *options]) == 0
    assert calls == [Access(allowed_hosts=("voice.example", "10.0.0.5"), trusted_proxies=("10.0.0.0/8", "192.0.2.7"))]
    assert cli.main(["serve", "--trusted-proxy", "proxy.example"]) == 2
    assert capsys.readouterr().err.endswith(
        "cadence-fx serve: error: trusted proxy 'proxy.example' must be an IP address (10.0.0.5), a network (10.0.0.0/8) or '*'\n"
    )


def test_a_key_only_subprotocol_offer_is_accepted_with_that_entry(keyed):
    """A browser page that offers only the key entry (no "realtime") must get one of its offer
    back, or the browser fails the handshake: the server selects the key entry, the client's own."""
    entry = f"openai-insecure-api-key.{KEY}"

    async def scenario():
        async with websockets.connect(keyed.handle.ws_url + "/v1/realtime", subprotocols=[entry]) as ws:
            return ws.subprotocol, json.loads(await ws.recv())["type"]

    assert run(scenario()) == (entry, "session.created")
