"""The vLLM servers behind the gateway as a fleet: the pool that sends calls, where rollouts go, health checks
and weights, and the fleet's state that every gateway process holds alike through the store (`sync`)."""
