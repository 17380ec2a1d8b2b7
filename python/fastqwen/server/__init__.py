"""The HTTP server: an OpenAI-compatible API and SGLang's native /generate over one engine thread."""
