"""Corpus to training tokens: tokenizer, JSONL reading, preprocessing, blending, offline assets."""
