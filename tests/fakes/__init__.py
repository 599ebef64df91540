"""Fakes of what lies outside the project: LLM services speaking real HTTP on loopback."""
