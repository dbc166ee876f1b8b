"""The tokenizer worker: text -> token ids, prompt validation, rejects back to the API."""
