"""Building blocks of the OpenAI-compatible Realtime API (``GET /v1/realtime``).

The pieces a realtime voice session is assembled from, each usable and tested on its own:
``audio_formats`` (the session's audio formats: 24 kHz PCM, G.711 mu-law and A-law, with
streaming conversion to and from the rates the models want; ``g711`` and ``resample``
beneath it), ``turns`` (the pure server-VAD turn detector: speech probabilities in,
``SpeechStarted``/``SpeechStopped`` out, with Realtime's ``turn_detection`` parameters)
and ``vad`` (Silero VAD, as faster-whisper ships it, scoring streamed audio for the
detector), and ``stats`` (the session counters that /metrics, the dashboard and
``omnistage status`` show); the session state and the WebSocket endpoint
(``api/routes/realtime.py``) are built on them.
"""
