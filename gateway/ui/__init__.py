"""The rollout viewer (`GET /ui`): the store's rollouts, turns and rewards as pages, every asset served by
the gateway."""
