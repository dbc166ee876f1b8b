"""The detokenizer: token ids -> text deltas, stop strings, back to the API."""
