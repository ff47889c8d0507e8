"""A short fault soak (4 sessions x 12 s; the 16 x 10 min run is bench/soak.py): every fault kind
happens, every event arrives once, every input byte and output sample is accounted, on the
client's ledger and on the server's, and the stop drains every session."""

from __future__ import annotations

import asyncio

from servekit import run
from soakkit import STEPS, run_soak, soak_limits, soak_model, summarize

from cadence_fx.serve.app import background_server

SESSIONS, SECONDS, SEED = 4, 12.0, 1


def test_a_short_soak_loses_nothing_and_every_ledger_balances():
    with background_server(soak_model, soak_limits(SESSIONS)) as handle:

        async def stop() -> None:
            await asyncio.to_thread(handle.stop)

        ledgers = run(run_soak(handle.ws_url, SESSIONS, SECONDS, SEED, stop))
        server = handle.manager.ended_ledgers
    summary = summarize(ledgers)
    assert summary["violations"] == {}
    assert (summary["lost_events"], summary["server_errors"]) == (0, 0)
    assert summary["input_accounted"] and summary["output_samples_accounted"]
    assert summary["shutdown"] == {"session.closed server_shutdown, close 1001": SESSIONS}
    assert set(summary["steps"]) == set(STEPS)
    totals = summary["totals"]
    assert min(totals["resumes"], totals["slow_consumer_closes"], totals["barge_ins"]) > 0
    assert summary["responses"]["cancelled"] > 0
    for client in ledgers:
        ledger = server[client.session_id]
        ledger.check()
        assert ledger.input.received_bytes == client.appended - client.refused
        assert (ledger.input.committed_bytes, ledger.input.cleared_bytes) == (client.committed, client.cleared)
        assert ledger.input.buffered_bytes == 0
        assert ledger.playback.delivered_bytes == 2 * client.delta_samples
