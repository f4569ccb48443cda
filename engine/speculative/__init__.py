"""Speculative decoding: drafts proposed per request, verified in the step's one forward."""
