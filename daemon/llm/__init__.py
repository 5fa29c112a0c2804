"""LLM backends, token rendering, tool-call parsing and routing."""
