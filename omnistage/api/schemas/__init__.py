"""Request bodies of the OpenAI-compatible endpoints, one module per route (chat,
completions, responses, speech, images, transcriptions) over what they share (base).
Reading a body is ``api.body``'s."""
