"""Prefill worker: runs prompts, ships their KV and first token to a decode worker."""
