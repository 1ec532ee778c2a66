"""The fleet: the vLLM servers behind the gateway and what this process knows of them, the engine client that
sends them calls, where rollouts go, their health checks and weight versions."""
