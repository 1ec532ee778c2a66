"""Admin API: pause and resume for weight syncs, policy versions, state."""
