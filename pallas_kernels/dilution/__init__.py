"""dilution."""
