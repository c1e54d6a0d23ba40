"""The engine's `tollgate` subcommands, one module each: `models` and `engine`."""
