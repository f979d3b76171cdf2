"""Proposers: the ways specserve guesses draft tokens for the target to verify (one file per method, one entry in
`registry.py`)."""
