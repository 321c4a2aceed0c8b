"""OpenAI-facing serving pieces: chat template, reasoning and tool-call parsers."""
