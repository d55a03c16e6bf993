"""megapipe.parallel."""
