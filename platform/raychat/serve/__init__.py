"""Serving on Ray Serve: ingress, engine replicas, OpenAI API, SSE, the chat page, vLLM config."""
