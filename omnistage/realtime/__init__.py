"""Building blocks of the OpenAI-compatible Realtime API (``GET /v1/realtime``).

The package holds the pieces a realtime voice session is assembled from, each usable and
tested on its own: ``turns`` is the pure server-VAD turn detector (speech probabilities in,
``SpeechStarted``/``SpeechStopped`` events out, with Realtime's ``turn_detection`` parameters),
and ``vad`` scores streamed PCM16 audio with the Silero VAD model that faster-whisper ships
and feeds the detector. Nothing outside this package imports it yet; the WebSocket endpoint
and its session state are built on top of it.
"""
