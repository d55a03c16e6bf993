"""megapipe: raw text to a served language model, one command per stage, one checkpoint format."""

__version__ = "0.1.0"
