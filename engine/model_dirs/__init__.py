"""Model directories on disk, outside the serving path: random-weight models and LoRA adapters
made for tests and demos, known models fetched into the cache and listed, a model's weights and
KV cache sized. `tollgate models` (`engine.commands.models`) is their command line."""
