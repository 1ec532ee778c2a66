"""The fleet: the vLLM servers behind the gateway, the pool that sends them calls, where rollouts go, their
health checks and weight versions."""
