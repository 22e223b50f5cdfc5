"""Checkpoint files read into the lean forward's weights (``engine.llama.LlamaWeights``), one tensor at a time."""
