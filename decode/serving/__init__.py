"""Drafts in and out of serving formats (HF, vLLM, speculators, GGUF) and llama.cpp's server."""
