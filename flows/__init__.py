"""Prefect flows: thin, one per job; they call components and add retries, progress and artifacts."""
