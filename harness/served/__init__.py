"""The served scenario: a Qwen3-architecture model served over an OpenAI-compatible endpoint, the
traces replayed against it, and the client that times every token (see README.md beside this file)."""
