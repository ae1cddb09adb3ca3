"""ebb-engine serve: an OpenAI-compatible local HTTP endpoint (api: the shape; worker: the one engine thread; http: Starlette + uvicorn)."""
