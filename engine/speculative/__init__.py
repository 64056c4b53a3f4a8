"""Speculative decoding (Leviathan et al., 2023): proposers draft K tokens, the target verifies them in one step.

- ``acceptance``: the acceptance rule, one pure function over tensors (greedy and modified rejection sampling).
- ``adaptive``: per-sequence K from a running acceptance rate.
- ``proposer``: the interface every drafter implements; ``ngram`` and ``draft_model`` implement it.
- ``speculator``: what the engine calls each step (ask the proposer, return the step with the drafts added,
  report back).
"""
