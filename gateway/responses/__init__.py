"""The OpenAI Responses dialect (Codex CLI, the OpenAI Agents SDK): translated to chat, captured as chat."""
