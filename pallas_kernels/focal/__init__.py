"""focal."""
