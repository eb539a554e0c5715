"""raychat: a small chat language model from raw text to a served, monitored chat endpoint, on Ray."""

__version__ = "0.1.0"
