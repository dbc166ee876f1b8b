"""Text to token ids and back, shared by the processes that need it: the API, the tokenizer
workers, the detokenizer and the scheduler's grammar compiler (hf_tokenizer.py, prompts.py)."""
