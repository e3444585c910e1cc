"""Benchmarks: the service's decoders side by side with diffusers, same weights, same process."""
