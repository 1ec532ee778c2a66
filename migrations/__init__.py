"""Alembic migrations of the gateway store."""
