"""The in-process engine: scheduler, model runner, sampler."""
