"""The OpenAI-compatible Realtime API (``GET /v1/realtime``): one voice session's parts.

``session`` (the session: client events in, server events out) sits above its parts,
which see it only as ``context.SessionHost``: ``audio_input`` (hears: input buffer,
server VAD from ``omnistage.audio``, the ``user_turn`` being spoken, its phrases heard
by ``listening``), ``turn_taking`` (what the turns mean: barge-in, early answers held
by ``gate``, commits) and ``answers`` (the session's answers, each a ``response_run``).
``events`` holds the wire events, client and server, as msgspec Structs; ``options``
the session and response settings a client sends, decoded by msgspec, applied by
``config`` and ``replies``; ``conversation`` the items. Beside them: ``secrets``
(signed ``ek_`` client secrets) and ``stats`` (the counters /metrics, the dashboard and
``omnistage status`` show). The socket is ``api/routes/realtime.py``'s.
"""
