"""`python -m m31r_lsp`: the language server without the `m31r` CLI (same options as `m31r lsp`)."""

from m31r_lsp.server import _main

_main()
