"""What a client gets when the server goes away: a graceful shutdown drains (responses run to
their end within ``Limits.drain_s``, then ``session.closed`` ``server_shutdown`` and 1001); a
crash gives 1006, and the resume that follows is refused with ``session_not_found``.

Stopping a server here takes the path SIGTERM takes (uvicorn's signal handler only asks the server
to exit); bench/soak.py ends its run with a real SIGTERM to a server process."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import pytest
import websockets
from servekit import RESPONSE_TAIL, Server, run, types_of

from cadence_fx.serve.app import background_server, free_port
from cadence_fx.serve.plugins import ToneModel
from cadence_fx.serve.session import Limits

SHUTDOWN_FAILURE = {
    "type": "server_error",
    "code": "server_shutdown",
    "message": "the server shut down before the response ended",
}


async def _replying(server: Server, path: str, question_pcm: bytes):
    """A socket whose session streams the question's 56-chunk reply, its first delta read."""
    sock = await server.connect(path)
    await sock.no_vad()
    await sock.append(question_pcm)
    await sock.send({"type": "input_audio_buffer.commit"})
    await sock.send({"type": "response.create"})
    await sock.recv_until("response.output_audio.delta")
    return sock


async def _until_closed(sock) -> list[dict]:
    events = []
    with contextlib.suppress(websockets.ConnectionClosed):
        while True:
            events.append(await sock.recv(timeout=20))
    return events


@pytest.mark.parametrize(("drain_s", "status"), [(0.2, "failed"), (10.0, "completed")])
def test_a_stopping_server_drains_and_says_so_before_it_closes(question_pcm, drain_s, status):
    limits = Limits(max_sessions_per_client=64, drain_s=drain_s)

    async def scenario(server):
        duplex = await _replying(server, "/v1/duplex", question_pcm)
        realtime = await _replying(server, "/v1/realtime", question_pcm)
        stopping = asyncio.create_task(asyncio.to_thread(server.handle.stop))
        ends = [await _until_closed(duplex), await _until_closed(realtime)]
        await stopping
        return duplex.session_id, ends, [(s.ws.close_code, s.ws.close_reason) for s in (duplex, realtime)]

    with background_server(lambda: ToneModel(step_delay_s=0.05), limits) as handle:
        session_id, (duplex, realtime), closes = run(scenario(Server(handle)))
    assert types_of(duplex)[-6:] == [*RESPONSE_TAIL, "session.closed"]
    assert types_of(realtime)[-5:] == RESPONSE_TAIL  # session.closed is a duplex event
    for done in (duplex[-2], realtime[-1]):
        assert done["response"]["status"] == status
        if status == "failed":
            assert done["response"]["status_details"] == {"type": "failed", "error": SHUTDOWN_FAILURE}
    assert (duplex[-1]["session_id"], duplex[-1]["reason"]) == (session_id, "server_shutdown")
    assert closes == [(1001, "server_shutdown"), (1001, "server_shutdown")]


# ---------------------------------------------------------------- a server in its own process

_SERVE = """
import sys
from cadence_fx.serve.app import Server, create_app, uvicorn_config
from cadence_fx.serve.plugins import ToneModel
from cadence_fx.serve.session import Limits
limits = Limits()
app = create_app(lambda: ToneModel(step_delay_s=0.05), limits)
Server(uvicorn_config(app, "127.0.0.1", int(sys.argv[1]), limits)).run()
"""


@contextlib.contextmanager
def _server_process(port: int):
    proc = subprocess.Popen([sys.executable, "-c", _SERVE, str(port)])
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"the server exited with {proc.returncode}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, "the server did not answer /health within 60 s"
            time.sleep(0.1)
        yield proc, Server(SimpleNamespace(ws_url=f"ws://127.0.0.1:{port}"))
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def test_a_crash_gives_1006_and_leaves_nothing_to_resume(question_pcm):
    """kill -9 mid-response: the socket drops without a close frame or a response.done; the server
    that comes back on the port knows no session, so the client learns it needs a new one."""
    port = free_port()

    async def crash(proc, server):
        sock = await _replying(server, "/v1/duplex", question_pcm)
        proc.send_signal(signal.SIGKILL)
        return sock, await _until_closed(sock)

    async def resume(server, lost):
        back = await server.connect(f"/v1/duplex?session_id={lost.session_id}", created=False)
        resume = {
            "type": "session.resume",
            "session_id": lost.session_id,
            "resume_token": lost.resume_token,
            "last_server_event_seq": 0,
        }
        await back.send(resume)
        refused = await back.recv()
        await back.close()
        return refused

    with _server_process(port) as (proc, server):
        lost, crashed = run(crash(proc, server))
    with background_server(ToneModel, port=port) as handle:
        refused = run(resume(Server(handle), lost))
    assert lost.ws.close_code == 1006 and "response.done" not in types_of(crashed)
    assert (refused["error"]["code"], refused["error"]["param"]) == ("session_not_found", "session_id")
