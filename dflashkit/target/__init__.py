"""The target model: loading, the adapter the decode loop sees, its fast CPU forward, log-probabilities."""
