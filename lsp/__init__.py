"""m31r's language server (`m31r lsp`): inline completions from the m31r daemon for any editor.

Modules: server (pygls server, handlers, `run`), completion (requests → daemon Fim → suggestions),
daemon_link (the shared m31r_protocol.reconnect connection, as the editor is told of it), settings,
documents (positions ↔ offsets).
The completion policy itself is `m31r_protocol.policy`, shared with the HTTP adapter.
"""
