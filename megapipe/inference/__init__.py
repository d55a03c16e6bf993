"""megapipe.inference."""
