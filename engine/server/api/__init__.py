"""OpenAI's API shapes, one module per endpoint (chat, completions, embeddings) and what
they share (common). Pure: no HTTP and no llama.cpp here, so every rule about what a request
may hold is tested on its own. What is refused, and why, is said in OpenAI's error shape
(`ApiError.body`)."""
