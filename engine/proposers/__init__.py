"""Proposers: the ways specserve guesses draft tokens for the target to verify."""
