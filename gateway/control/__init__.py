"""Control API for environments and orchestrators: rollouts, rewards, finish."""
