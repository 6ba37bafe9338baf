"""The HTTP API, split by job: one streaming core and the protocol adapters over it.

``core`` moves a request's events from the engine thread to its handler and owns the live
requests (submission, disconnects, release); ``native``, ``completions`` and ``chat`` turn
SGLang's and OpenAI's bodies into core requests and the core's events into their
responses (shared OpenAI parts in ``openai_common``); ``info`` serves the small
health, info, control and metrics endpoints; ``wire`` holds the SSE and error formats.
``runtime.server.create_app`` wires them together.
"""
