"""Decode worker: receives prompts' KV from prefill workers and generates."""
