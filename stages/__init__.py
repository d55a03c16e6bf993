"""One module per stage command; each defines ``register(app)``. Thin: parse options, build config, call the library."""
