"""Checkpoint generation and loading: tokenizer, config and weights on disk."""
