"""Audio code both engines and the API use: WAV and PCM helpers, formats, G.711,
resampling, voice activity."""
