"""Inference engine: a Llama-family decoder over a paged KV cache with continuous batching.

Entry points: `engine.llm_engine.LLMEngine` (synchronous, one step at a time) and
`engine.async_engine.AsyncEngine` (asyncio, step loop on a background thread).
"""
