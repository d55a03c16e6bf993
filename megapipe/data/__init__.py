"""megapipe.data."""
