"""The protocol's version and limits, importable without msgspec (the blocking status client needs them)."""

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 8 * 1024 * 1024  # a whole large source file fits; anything bigger is refused unread
MAX_BEAMS = 8  # the widest beam search a request may ask for (the daemon's m31r.beams.MAX_BEAMS; a test ties them)
MAX_LOGPROBS = 20  # the likeliest tokens a request may ask for at each step (`logprobs`; as OpenAI's chat API)
MAX_SNIPPETS = 8  # snippets of other files a Fim may carry (`context`): more never fit a quarter of the context
MAX_STOPS = 32  # stop sequences a request may carry: each is matched on every token, on the one inference thread
MAX_STOP_CHARS = 1024  # and each at most this long (a whole line of code fits)
# and all of them together at most this long: the matching's worst case per token is what 16 of the longest cost,
# while a plugin's many short ones fit (Continue sends 12 to 14, Zed 14, with the user's own on top)
MAX_STOPS_CHARS = 16 * MAX_STOP_CHARS
