"""Training drafters: prompt sources, data regeneration by the target, the shard format, losses and the trainer."""
