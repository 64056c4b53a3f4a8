"""Sampling: the parameters of a request, the sampler over a batch of logits, and grammar constraints."""
