"""Small helpers shared across the library (standard library only)."""
