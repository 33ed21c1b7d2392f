"""The embedded engine: the model and its presets, the tokenizer, the scheduler and its loop, sequences and the prefix
cache over the tiered cache, building the model from weights and exporting them."""
