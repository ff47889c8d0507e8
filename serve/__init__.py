"""The duplex service: OpenAI Realtime over WebSocket for cadence-fx-transformed models.

Layers (dependencies point down): ``app`` (FastAPI/uvicorn routes) -> ``session`` (owners,
lease, journal, ledgers, VAD) -> ``protocol`` (typed commands/events, the codec, audio formats)
and ``plugins`` (the model seam). Entry points: ``app.run_server`` and ``client.run_client``; the
``cadence-fx`` commands ``serve``, ``prompt`` and ``client`` are ``cli.add_commands``.
Nothing is imported here, so that the protocol layer loads without the web stack.
"""
