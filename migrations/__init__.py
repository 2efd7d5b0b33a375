"""Alembic migrations for the router store (script location: this folder)."""
