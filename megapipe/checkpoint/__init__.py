"""megapipe.checkpoint."""
