"""condense."""
