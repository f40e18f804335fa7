"""Probes: plain functions that return flat ``dict[str, float]`` metrics."""
