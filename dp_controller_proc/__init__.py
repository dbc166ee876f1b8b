"""The data-parallel controller process (--dp-size > 1): see process.py."""
