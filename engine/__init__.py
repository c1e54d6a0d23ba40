"""Inference engine: a Llama-family decoder over a paged KV cache with continuous batching.

Entry points: `engine.llm_engine.LLMEngine` (synchronous, one step at a time) and
`engine.process_engine.ProcessEngine` (asyncio, the engine in a child process), an
`engine.front.EngineFront`.
"""
