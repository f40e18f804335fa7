"""Stand-in: importable, nothing else."""
