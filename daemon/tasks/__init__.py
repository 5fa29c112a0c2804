"""Task handlers and their registry."""
