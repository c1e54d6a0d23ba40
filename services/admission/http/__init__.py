"""Admission's HTTP front door: OpenAI-compatible routes beside gRPC, same keys and runs."""
