"""One module per ``parity`` verb, each with ``register(subparsers)`` and ``run(args) -> int``."""
