"""Images in, torch-free (Pillow + numpy), for the tokenizer processes: where an image may
come from and what it may cost (sources.py), and each vision family's preprocessing as its
preprocessor_config.json says, with the expansion of a prompt's image placeholders into the
model's image tokens (processors.py). The model package runs the encoders; nothing here
imports torch or any *_proc package."""
