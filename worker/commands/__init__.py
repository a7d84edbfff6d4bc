"""CLI subcommands, one module each; each exposes ``configure(parser)`` and ``run(args) -> int``."""
