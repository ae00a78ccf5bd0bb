"""Speech engines: text to speech (Piper) and speech to text (Whisper)."""
