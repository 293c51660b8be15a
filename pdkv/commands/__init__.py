"""Subcommands of the ``pdkv`` CLI, one module per capability."""
