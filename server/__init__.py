"""The front door: OpenAI-compatible HTTP API and the ferry CLI."""
