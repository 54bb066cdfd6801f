"""`m31r serve`: the localhost HTTP adapter, a thin client of the daemon socket (README "HTTP adapter"); its
connection to the daemon is m31r_protocol.reconnect's, shared with the other front ends.

Importing this package (or any module in it) never imports torch: the daemon owns the model.

    schemas.py   request/response msgspec Structs and the OpenAPI document generated from them
    security.py  Host check (DNS rebinding), Origin allow-list, bearer token file
    metrics.py   Prometheus metrics
    app.py       the Starlette application (endpoints, streaming, cancellation)
    ollama.py    Ollama's API (/api/generate, /api/show, /api/tags, /api/version) for plugins written for Ollama
    llamacpp.py  llama.cpp server's /infill, for its editor plugins (llama.vim, llama.vscode)
    tabby.py     Tabby's API (/v1/health, /v1/completions with `segments`, /v1/events) for tabby-agent's plugins
    fim_templates.py  other model families' FIM prompt layouts, split back into prefix and suffix
    server.py    `run(...)`: uvicorn on uvloop
"""
