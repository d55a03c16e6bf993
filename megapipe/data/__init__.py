"""megapipe.data: tokenizers, .bin/.idx datasets (with their tokenizer sidecar), preprocessing, GPT samples."""


def check_data_tokenizer(prefixes, tokenizer, hint: str = "or pass --allow-tokenizer-mismatch to use it anyway"):
    """See :func:`megapipe.data.sidecar.check_data_tokenizer` (imported lazily: ``megapipe.data`` stays cheap)."""
    from megapipe.data.sidecar import check_data_tokenizer as check

    return check(prefixes, tokenizer, hint)
