"""slime and Megatron-LM flags on `lichen train`: what lichen does with each one (one table, `flags.py` with
`flags_data.py` and `parser_flags.py`), the classification of one invocation (`compat.py`), and the architecture
flags checked against config.json (`megatron_model.py`). docs/slime-compat.md is the user's view of the table."""
