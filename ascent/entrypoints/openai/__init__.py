"""The OpenAI-compatible server: ``build_app`` (FastAPI over an ``AsyncLLM``) and ``run_server`` (``ascent serve``)."""
