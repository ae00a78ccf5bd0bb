#!/usr/bin/env bash
# Install omnistage into .venv (first run only takes long) and serve the default pipeline.
# Extra arguments go to `omnistage serve`, e.g. ./scripts/serve.sh echo-fanout --port 9000
source "$(dirname "$0")/env.sh"
"$VENV/bin/pip" install -q -e "$ROOT"
exec "$VENV/bin/omnistage" serve "$@"
