"""megapipe.data: tokenizers, .bin/.idx datasets (with their tokenizer sidecar), preprocessing, GPT samples."""
