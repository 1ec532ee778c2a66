"""Environment gateway: an OpenAI-compatible proxy in front of vLLM that records every turn's exact tokens."""

__version__ = "0.1.0"
