"""kvgate's torch-free core: settings and YAML, atomic files and JSONL, rules, and the run data's schema.

Everything that only reads configs, keys or run data (the CLI's help, `init`, `report`, config
validation, the renderer) builds on this package and never imports torch.
"""
