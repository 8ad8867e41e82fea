"""Credentials kept out of everything a run prints or writes: the one redaction (`redact`).

Every line ppo-train prints on error, DIR/error.log, config.json's `config` and `command`, and the config a tracker
stores pass through `redact`, which replaces by ***
  - in each URL: its userinfo (user:password@) and the values of the query and fragment parameters whose names
    name a credential (SECRET_QUERY_KEYS: key=, token=, api_key=, secret=, password=, ...);
  - anywhere: each secret `remember_secrets` was given (the command line's and the config's URLs, the reward
    server's keys from the environment), as written, percent-decoded, and escaped as repr() and JSON escape it.
The second covers what the first cannot see: a URL cut in two by a space or a quote in its password, a password with
# / ? that ends the host part early, a password quoted inside a list's repr. A secret shorter than MIN_SECRET_CHARS
is left to the first (replacing 3 characters everywhere would mangle the text around them).
"""
import json
import re
import urllib.parse

SECRET_QUERY_KEYS = ("key", "token", "secret", "password", "passwd", "pwd", "auth", "signature", "credential")
"""A query parameter whose name (case-blind) contains one of these holds a credential: api_key, access_token, ..."""
MIN_SECRET_CHARS = 4
URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"]+")  # a URL inside a word: --reward_url=http://...
URL_START = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)(.*)", re.DOTALL)

_secrets: set = set()  # the strings redact() replaces wherever they appear (remember_secrets)


def _userinfo(url: str):
    """(scheme://, userinfo or None, the rest) of a URL. The userinfo ends at the LAST @ of the URL, not where a
    parser would end the host part (at the first / ? #): a password holding those characters is still all
    userinfo. A URL with an @ in its path or query loses its host in print, never a secret."""
    scheme, rest = URL_START.match(url).groups()
    if "@" not in rest:
        return scheme, None, rest
    userinfo, rest = rest.rsplit("@", 1)
    return scheme, userinfo, rest


def _secret_parameters(params: str, redacted: bool):
    """The values of the credential-naming parameters in 'a=1&api_key=K' (redacted=False), or the text with
    each of them replaced by *** (redacted=True)."""
    items = [item.partition("=") for item in params.split("&")]
    secret = [eq and any(word in urllib.parse.unquote_plus(name).lower() for word in SECRET_QUERY_KEYS)
              for name, eq, _ in items]
    if not redacted:
        return [value for (_, _, value), s in zip(items, secret) if s]
    return "&".join(f"{name}=***" if s else f"{name}{eq}{value}" for (name, eq, value), s in zip(items, secret))


def redact_url(url: str) -> str:
    """The URL as it may be printed or stored: its userinfo and its credential parameters replaced by ***.
    'http://u:p@h:1/s?api_key=K&n=4' -> 'http://***:***@h:1/s?api_key=***&n=4'. Idempotent; text that is not a URL
    comes back as it is, and a URL that cannot be parsed as '<unparsable URL>' (it could hold anything)."""
    if not URL_START.match(url):
        return url
    try:
        urllib.parse.urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    scheme, userinfo, rest = _userinfo(url)
    head = scheme if userinfo is None else scheme + ("***:***@" if ":" in userinfo else "***@")
    rest, hash_, fragment = rest.partition("#")
    rest, mark, query = rest.partition("?")
    return (head + rest + mark + (_secret_parameters(query, True) if query else "")
            + hash_ + (_secret_parameters(fragment, True) if fragment else ""))


def url_secrets(url: str) -> list:
    """The credentials inside one URL: its password (or its userinfo when that is a token alone; not a user's name,
    which redact_url hides where it can be seen: 'trainer' would be replaced in every line), the values of its
    credential parameters."""
    match = URL_START.search(url)
    if not match:
        return []
    _, userinfo, rest = _userinfo(url[match.start():])
    found = []
    if userinfo is not None:  # user:password, or a token alone
        found.append(userinfo.partition(":")[2] if ":" in userinfo else userinfo)
    rest, _, fragment = rest.partition("#")
    query = rest.partition("?")[2]
    return found + _secret_parameters(query, False) + _secret_parameters(fragment, False)


def remember_secrets(values, whole=False):
    """Make redact() replace the credentials inside `values` (strings, or lists or dicts of them) wherever they
    appear from now on: those of every URL in them (url_secrets; a command-line word --key=URL is read from its
    =, and a list value both whole and split at its commas), or, with whole=True, each string itself (a key from
    the environment)."""
    if isinstance(values, dict):
        values = list(values.values())
    if not isinstance(values, (list, tuple)):
        values = [values]
    for value in values:
        if isinstance(value, (list, tuple, dict)):
            remember_secrets(value, whole)
            continue
        if not isinstance(value, str):
            continue
        found = [value] if whole else []
        if not whole and "://" in value:
            text = value.split("=", 1)[1] if value.startswith("--") and "=" in value else value
            for piece in [text] + text.split(","):
                found += url_secrets(piece.strip())
        for secret in found:
            for form in (secret, urllib.parse.unquote(secret), urllib.parse.unquote_plus(secret)):
                if len(form) >= MIN_SECRET_CHARS:
                    _secrets.update({form, repr(form)[1:-1], json.dumps(form)[1:-1],
                                     json.dumps(form, ensure_ascii=False)[1:-1]})


def forget_secrets():
    """Forget what remember_secrets was given (a new command starts)."""
    _secrets.clear()


def redact(value):
    """A text, config value, command-line word, or a list, tuple or dict of them, with every credential replaced by
    *** (the secrets remember_secrets was given, then each URL's redact_url): what may be printed, written into the
    run directory or sent to a tracker. A resume takes a credential again from the command line or the environment,
    never from what was written."""
    if isinstance(value, str):
        for secret in sorted(_secrets, key=len, reverse=True):  # the longest first: before a shorter one inside it
            value = value.replace(secret, "***")
        return URL_IN_TEXT.sub(lambda m: redact_url(m.group()), value) if "://" in value else value
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    if isinstance(value, dict):
        return {k: redact(v) for k, v in value.items()}
    return value
