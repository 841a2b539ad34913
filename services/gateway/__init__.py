"""The gateway: Tidal's OpenAI-compatible HTTP API (Litestar on uvicorn), submitting over NATS.

Modules: `server` (process lifecycle), `app` + `edge` (ASGI app and its front door), the
endpoints (`completions`, `chat`, `routes_misc`), their bodies (`api_*`), request preparation
(`prep`, `tokenizers`, `catalog`), the NATS side (`hub`, `generation`, `seq_order`) and the
response side (`streaming`, `sse`, `logprobs`). See docs/api.md.
"""
