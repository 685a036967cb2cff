"""glue."""
