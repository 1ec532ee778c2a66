"""The vLLM servers behind the gateway as a fleet: their health and models, and which server a rollout is
pinned to."""
