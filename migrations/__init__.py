"""Alembic migrations of the store (shipped as rollout_store.migrations)."""
