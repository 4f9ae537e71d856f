"""ferry execution engine: models, paged KV cache, scheduler, runner, sampler."""
