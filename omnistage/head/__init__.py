"""The head process: HTTP API, orchestrator, stage pools, master, coordinator, launchers.

``process.Head`` is the thin shell (signals, start, shutdown); the pieces it wires are
each in a module of their own here, or pure state in ``control/`` and ``dataplane/``.
"""
