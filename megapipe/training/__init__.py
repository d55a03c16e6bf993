"""megapipe.training."""
