"""Building blocks of the Realtime API (GET /v1/realtime)."""
