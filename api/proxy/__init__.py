"""The OpenAI-compatible proxy: routes, forwards, streams and books every request itself (see README.md)."""
