"""specstop: learned stopping predictors for speculative decoding, end to end."""

__version__ = "0.1.0"
