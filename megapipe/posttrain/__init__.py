"""megapipe.posttrain."""
