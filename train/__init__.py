"""Training pipeline for the bundled demo pair: corpus, tokenizer, target, distilled draft, CLI.

Self-contained: imports nothing from the rest of `engine`, so it runs before the engine exists.
"""
