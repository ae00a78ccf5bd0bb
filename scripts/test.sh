#!/usr/bin/env bash
# Install omnistage with its test tools into .venv, lint, and run the whole test suite.
# Extra arguments go to pytest, e.g. ./scripts/test.sh tests/unit -x
source "$(dirname "$0")/env.sh"
"$VENV/bin/pip" install -q -e "$ROOT[test]"
cd "$ROOT"
"$VENV/bin/ruff" check omnistage tests bench
"$VENV/bin/ruff" format --check omnistage tests bench
exec "$VENV/bin/python" -m pytest "${@:-tests}" -q -ra
