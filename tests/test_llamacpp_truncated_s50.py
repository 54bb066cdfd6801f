"""llama.cpp's `truncated` on `m31r serve`'s /infill and llama.cpp-style /completion: true where the prompt lost text
to fit the context, from the daemon's Done.truncated (set where m31r.fim cut a Fim's prefix or suffix to its budget,
or a Generate with `truncate` lost its start). Once always false: the daemon fitted every prompt without saying so.

A real daemon (the shared one, on the tiny random-weight bundle: a 512-token context, a FIM budget of 64 suffix
tokens, 32 for the cursor line and 349 for the lines above) on its real socket, and a real `m31r serve` over HTTP.
"""

from __future__ import annotations

import json

import pytest
from test_llamacpp_api import http, server  # noqa: F401 (fixtures: a real `m31r serve` on the shared daemon)

from m31r_protocol import Client
from m31r_protocol.messages import Snippet

pytestmark = pytest.mark.timeout(120)

CAP = 8  # n_predict: short answers, the tests are about the prompt
PREFIX = "fn main() {\n    let total = add(1, 2);\n"
MIDDLE = "    println!("
SUFFIX = ");\n}\n"
LONG_ABOVE = "".join(f"    let value_{i} = compute({i}, {i + 1});\n" for i in range(60))  # ~2400 bytes: past 349
LONG_BELOW = "".join(f"    check(value_{i});\n" for i in range(40))  # ~800 bytes: past the suffix's 64
LONG_LINE = "    let s = " + " + ".join(f"part_{i}" for i in range(40))  # a cursor line past its 32


# -- the daemon's Done ------------------------------------------------------------------------------------------

FIM_CASES = {
    "short": (PREFIX + MIDDLE, SUFFIX, False),
    "healed_word": (PREFIX + "    let tot", SUFFIX, False),  # healing moves a token, loses no text
    "empty": ("", "", False),
    "lines_above": ("fn main() {\n" + LONG_ABOVE + MIDDLE, SUFFIX, True),
    "lines_below": (PREFIX + MIDDLE, SUFFIX + LONG_BELOW, True),
    "cursor_line": (PREFIX + LONG_LINE, SUFFIX, True),
}


@pytest.mark.parametrize("case", FIM_CASES)
async def test_fim_done_says_whether_the_prompt_was_cut(shared_daemon, case) -> None:
    prefix, suffix, cut = FIM_CASES[case]
    async with await Client.connect(shared_daemon[1]) as c:
        _, done = await (await c.fim(prefix, suffix, max_tokens=4)).collect()
    assert done.truncated is cut, (case, done)


async def test_snippets_left_out_for_room_are_no_cut(shared_daemon) -> None:
    """Context snippets are laid before the prompt as room allows: those left out are not the request's code cut."""
    snippets = [Snippet("pub fn helper(x: u32) -> u32 {\n" + "    x + 1;\n" * 60 + "}\n", f"src/h{i}.rs")
                for i in range(4)]
    async with await Client.connect(shared_daemon[1]) as c:
        _, done = await (await c.fim(PREFIX + MIDDLE, SUFFIX, max_tokens=4, context=snippets)).collect()
    assert done.truncated is False, done


async def test_generate_done_says_whether_truncate_cut_the_start(shared_daemon) -> None:
    async with await Client.connect(shared_daemon[1]) as c:
        _, short = await (await c.generate(PREFIX, max_tokens=4, truncate=True)).collect()
        _, long = await (await c.generate(LONG_ABOVE, max_tokens=4, truncate=True)).collect()
    assert short.truncated is False and long.truncated is True, (short, long)
    assert long.usage.prompt_tokens + 4 <= 512  # (it was cut: the prompt alone is longer than the context)


# -- over HTTP ----------------------------------------------------------------------------------------------------


def last_event(text: str) -> dict:
    return json.loads([e for e in text.split("\n\n") if e][-1].removeprefix("data: "))


@pytest.mark.parametrize(("above", "middle", "below", "cut"), [
    (PREFIX, MIDDLE, SUFFIX, False),
    ("fn main() {\n" + LONG_ABOVE, MIDDLE, SUFFIX, True),
    (PREFIX, MIDDLE, SUFFIX + LONG_BELOW, True),
    (PREFIX, LONG_LINE, SUFFIX, True),
], ids=["short", "lines_above", "lines_below", "cursor_line"])
def test_infill_truncated(http, above, middle, below, cut) -> None:  # noqa: F811
    """/infill as the plugins send it: the whole answer, the stream's last event, and llama.vim's response_fields."""
    body = {"input_prefix": above, "prompt": middle, "input_suffix": below, "n_predict": CAP}
    a = http.post("/infill", json=body)
    assert a.status_code == 200 and a.json()["truncated"] is cut, a.text
    r = http.post("/infill", json={**body, "stream": True})
    assert r.status_code == 200 and last_event(r.text)["truncated"] is cut, r.text
    picked = http.post("/infill", json={**body, "response_fields": ["content", "truncated"]}).json()
    assert picked["truncated"] is cut, picked


@pytest.mark.parametrize(("prompt", "cut"), [
    (f"<fim_prefix>{PREFIX + MIDDLE}<fim_suffix>{SUFFIX}<fim_middle>", False),  # Continue's template: a Fim
    (f"<fim_prefix>{LONG_ABOVE + MIDDLE}<fim_suffix>{SUFFIX}<fim_middle>", True),
    (f"<fim_prefix>{PREFIX + MIDDLE}<fim_suffix>{SUFFIX + LONG_BELOW}<fim_middle>", True),
    (PREFIX, False),  # plain text: a Generate, whose start the daemon cuts where it does not fit
    (LONG_ABOVE, True),
], ids=["fim_short", "fim_lines_above", "fim_lines_below", "plain_short", "plain_long"])
def test_llamacpp_completion_truncated(http, prompt, cut) -> None:  # noqa: F811
    body = {"prompt": prompt, "n_predict": CAP}
    a = http.post("/completion", json=body)
    assert a.status_code == 200 and a.json()["truncated"] is cut, a.text
    r = http.post("/completion", json={**body, "stream": True})
    assert r.status_code == 200 and last_event(r.text)["truncated"] is cut, r.text


def test_the_native_answer_and_the_cli_carry_it(shared_daemon, http) -> None:  # noqa: F811
    """This server's own /generate and `m31r generate --json` pass Done.truncated on too."""
    import os
    import subprocess
    import sys

    for prompt, cut in ((PREFIX, False), (LONG_ABOVE, True)):
        got = http.post("/generate", json={"prompt": prompt, "max_tokens": 4, "truncate": True}).json()
        assert got["truncated"] is cut, got
        r = subprocess.run([sys.executable, "-m", "m31r.cli", "generate", prompt, "--truncate", "--json",
                            "--max-tokens", "4", "--socket", str(shared_daemon[1])], capture_output=True, text=True,
                           timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["truncated"] is cut, r.stdout
