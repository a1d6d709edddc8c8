"""Serving: ZeroQuant-quantized models behind an OpenAI-compatible HTTP API on Ray Serve.

protocol (requests, responses, ServeConfig), model (loading and quantizing what is served),
runner (the generation engine driven from asyncio), replica (the HTTP replica and the
expert-parallel rank as workers: routing, auth, limits), deploy (the driver: Ray Serve app,
expert-parallel graphs). Decoding is troupe.generation's engine."""
