"""The decode loop and what it calls: proposers, verification math, samplers, adaptive block size, caches."""
