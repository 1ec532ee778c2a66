"""OpenAI-compatible agent API: capture of engine tokens on the way through."""
