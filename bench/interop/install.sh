#!/usr/bin/env bash
# Installs the heavier clients bench/interop.py runs (about 600 MB of Python packages and 80 MB of
# npm packages) into the current Python and bench/interop/node_modules. The openai Python client
# comes with .ci/install (the test suite runs it).
set -euo pipefail
cd "$(dirname "$0")"
python3 -m pip install -q --disable-pip-version-check pipecat-ai==1.14.0 livekit-agents==1.8.9 livekit-plugins-openai==1.8.9
npm ci --no-audit --no-fund
