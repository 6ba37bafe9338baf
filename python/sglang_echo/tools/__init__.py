"""Helpers that make test fixtures and demo inputs (tiny checkpoints, prompts)."""
