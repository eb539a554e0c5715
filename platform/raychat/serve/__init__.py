"""Serving on Ray Serve: FastAPI ingress + autoscaled engine replicas (app.py), request validation (api.py),
SSE framing (sse.py), the web page (static/chat.html), the Serve config (serve/chat.yaml at the repo root), `raychat serve` (cli.py)
and a vLLM config builder over an exported Hugging Face directory (vllm.py, optional, GPU only)."""
