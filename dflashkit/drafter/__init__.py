"""The DFlash drafter: its network, fast forward, context cache, configuration, checkpoints and shipped drafters."""
