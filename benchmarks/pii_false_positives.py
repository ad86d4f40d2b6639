"""PII false positives on real technical text: the ``pii`` stage's rules before and after a revision.

File set (this machine's Debian/Ubuntu documentation; each file read once, symlinks resolved, ``.gz``
decompressed, files with NUL bytes skipped, one document per file):

* ``/usr/share/common-licenses/*``: the license texts;
* ``/usr/share/doc/*/copyright``: one per installed package;
* ``/usr/share/doc/*/README*``, ``NEWS*``, ``*.txt``, ``*.md`` at the top of each package's folder;
* with ``--changelogs``, also ``/usr/share/doc/*/changelog*`` (Debian and upstream change logs: a
  stress test of version strings, some 150 MB of text).

They hold essentially no personal data apart from the maintainers' and authors' e-mail addresses in
the copyright files (and a few company phone numbers in old license texts), so what the stage replaces
is mostly look-alikes: version strings, ZIP+4 codes, example addresses.

Judging rule, one replacement at a time, from the text around it:

* ip: a true positive only when the address is globally reachable unicast by the standard library's
  reading of the IANA registries (``ipaddress``: ``is_global`` and not ``is_multicast``) *and* the text
  within 200 characters of it speaks of networks (one of ``JUDGE_NETWORK_WORDS``) or it carries a port
  or prefix length (``:8080``, ``/24``). Everything else is a false positive: version and section numbers, and
  loopback, private, documentation and broadcast addresses (which identify no one: the issue's
  ``127.0.0.1``). A public resolver such as ``8.8.8.8`` in "DNS resolver at 8.8.8.8" counts as true:
  it is an address, even though it is nobody's;
* phone: a true positive only when a phone word (``JUDGE_PHONE_WORDS``: phone, tel, fax, call, dial,
  toll, contact, support, ...) is within the 150 characters before it or the 40 after it, or a US
  postal address (state and ZIP code) ends within the 40 characters before it (a contact block);
  otherwise (ZIP+4 codes, clause numbers, hex dumps, sizes) a false positive;
* card: every replacement is a false positive (no payment cards in package documentation);
* email: counted apart, since most are genuine addresses. A false positive when the last label of
  the domain is no top-level domain of the Public Suffix List on this machine
  (``/usr/share/publicsuffix/public_suffix_list.dat``; file and unit names such as ``ca@valencia.po``,
  ``getty@tty1.service``) or the domain is reserved for documentation (RFC 2606 / 6761:
  ``example.com``, ``.test``, ``.invalid``, ``.localhost``). This errs towards false positives:
  addresses at private names (``.local``, ``.lan``, ``.localdomain``) and at retired ones (``.yu``)
  are judged false although many are someone's (the stage replaces them on purpose).

The judge reads the same text as the stage, but it does not share its rules: it never asks whether a
dotted quad is a version, only whether the address is public and networking is being discussed.
``--show after`` (or ``before``) prints every replacement with its context and verdict, to check the
judge by eye.

"Before" is the ``pii`` module at ``--before`` (a git revision of this repository, loaded from ``git
show``), "after" the one in the working tree; both run with default parameters. To see exactly what
each replaced, the module's compiled patterns are wrapped so that their ``sub`` records every match
whose replacement differs from it: the stage's own code decides, the wrapper only watches.

    python benchmarks/pii_false_positives.py [--before e4a58cb] [--show after] [--changelogs]

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import ipaddress
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from lmforge.corpus.document import Doc

ROOT = Path(__file__).resolve().parents[1]
MODULE = "src/lmforge/corpus/stages/pii.py"
BEFORE = "e4a58cb9f889852c06355751f6d3b7135d9ed5ee"  # the last commit with the old rules
PATTERNS = {"_EMAIL": "email", "_IPV6": "ip", "_IPV4": "ip", "_CARD": "card", "_PHONE": "phone"}
KINDS = ("ip", "phone", "card", "email")

JUDGE_NETWORK_WORDS = frozenset(
    {"ip", "ipv4", "ipv6", "address", "addresses", "host", "hostname", "server", "servers", "dns", "resolver",
     "nameserver", "gateway", "router", "route", "ping", "proxy", "network", "netmask",
     "subnet", "port", "connect", "connecting", "listening", "localhost", "inet", "tcp", "udp"}
)  # fmt: skip
JUDGE_PHONE_WORDS = frozenset(
    {"phone", "telephone", "tel", "fax", "call", "dial", "toll", "contact", "mobile", "cell", "hotline",
     "voice", "ph", "support", "phones"}
)  # fmt: skip
RESERVED_DOMAINS = ("example.com", "example.net", "example.org")
RESERVED_TLDS = frozenset({"example", "test", "invalid", "localhost"})
PSL = Path("/usr/share/publicsuffix/public_suffix_list.dat")
_WORD = re.compile(r"[A-Za-z][A-Za-z0-9]*")
_POSTAL_ADDRESS = re.compile(r"\b[A-Z]{2}\s+\d{5}(?:-\d{4})?\s*$")


# ---------------------------------------------------------------------------------------------------------
# the files


def doc_files(changelogs: bool) -> list[Path]:
    """The file set of the module docstring, sorted, each real file once."""
    doc = Path("/usr/share/doc")
    candidates = list(Path("/usr/share/common-licenses").glob("*")) + list(doc.glob("*/copyright"))
    patterns = ["README*", "NEWS*", "*.txt", "*.md", "*.txt.gz", "*.md.gz"] + ["changelog*"] * changelogs
    for pattern in patterns:
        candidates += doc.glob(f"*/{pattern}")
    seen: dict[Path, Path] = {}
    for path in sorted(candidates):
        real = path.resolve()
        if real.is_file() and real not in seen:
            seen[real] = path
    return sorted(seen.values())


def read_text(path: Path) -> str | None:
    data = path.read_bytes()
    if path.suffix == ".gz":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError):
            return None
    if b"\0" in data:
        return None
    return data.decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------------------
# the stage, instrumented


@dataclass
class Hit:
    kind: str
    span: str
    before: str  # up to 200 characters before the match, in the text the pattern saw
    after: str  # up to 200 characters after it


class Recording:
    """Stands in for one of the module's compiled patterns; ``sub``/``subn`` record what they replace."""

    def __init__(self, pattern: re.Pattern[str], kind: str, hits: list[Hit]):
        self.pattern, self.kind, self.hits = pattern, kind, hits

    def subn(
        self, repl: str | Callable[[re.Match[str]], str], string: str, count: int = 0
    ) -> tuple[str, int]:
        def watched(m: re.Match[str]) -> str:
            out = repl(m) if callable(repl) else m.expand(repl)
            if out != m.group():
                s, e, t = m.start(), m.end(), m.string
                self.hits.append(Hit(self.kind, m.group(), t[max(0, s - 200) : s], t[e : e + 200]))
            return out

        return self.pattern.subn(watched, string, count)

    def sub(self, repl: str | Callable[[re.Match[str]], str], string: str, count: int = 0) -> str:
        return self.subn(repl, string, count)[0]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pattern, name)


def load_module(source: str, name: str) -> ModuleType:
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(name, f.name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    Path(f.name).unlink()
    return module


def instrumented(module: ModuleType) -> tuple[Any, list[Hit]]:
    """The module's stage with default parameters, and the list its patterns record hits into."""
    hits: list[Hit] = []
    for attr, kind in PATTERNS.items():
        setattr(module, attr, Recording(getattr(module, attr), kind, hits))
    return module.PiiRedact(), hits


# ---------------------------------------------------------------------------------------------------------
# the judge


def public_tlds() -> frozenset[str]:
    tlds = set()
    for raw in PSL.read_text(encoding="utf-8").splitlines():
        rule = raw.strip().removeprefix("!").removeprefix("*.")
        if rule and not rule.startswith("//"):
            tlds.add(rule.rsplit(".", 1)[-1].lower())
    return frozenset(tlds)


def words(text: str) -> set[str]:
    return {w.lower() for w in _WORD.findall(text)}


def is_false_positive(hit: Hit, tlds: frozenset[str]) -> bool:
    """The judging rule of the module docstring."""
    if hit.kind == "ip":
        ip = ipaddress.ip_address(hit.span)
        public = ip.is_global and not ip.is_multicast
        near = words(hit.before + " " + hit.after)
        networking = bool(near & JUDGE_NETWORK_WORDS) or re.match(r"[:/]\d", hit.after) is not None
        return not (public and networking)
    if hit.kind == "phone":
        cue = words(hit.before[-150:] + " " + hit.after[:40]) & JUDGE_PHONE_WORDS
        return not cue and not _POSTAL_ADDRESS.search(hit.before[-40:])
    if hit.kind == "email":
        domain = hit.span.rsplit("@", 1)[1].lower()
        tld = domain.rsplit(".", 1)[-1]
        reserved = tld in RESERVED_TLDS or any(
            domain == d or domain.endswith("." + d) for d in RESERVED_DOMAINS
        )
        return reserved or tld not in tlds
    return True  # card


# ---------------------------------------------------------------------------------------------------------


def measure(stage: Any, hits: list[Hit], texts: list[str], tlds: frozenset[str]) -> tuple[dict, list]:
    """Per kind: replacements, files with one, judged false positives; and every hit with its verdict."""
    figures = {k: {"replacements": 0, "files": 0, "false_positives": 0} for k in KINDS}
    verdicts = []
    for i, text in enumerate(texts):
        hits.clear()
        counts = stage.process(Doc(str(i), text, "prose")).meta["pii"]
        assert sum(counts.values()) == len(hits), (counts, hits)  # the wrapper saw every replacement
        for kind in KINDS:
            figures[kind]["replacements"] += counts[kind]
            figures[kind]["files"] += counts[kind] > 0
        for hit in hits:
            fp = is_false_positive(hit, tlds)
            figures[hit.kind]["false_positives"] += fp
            verdicts.append((hit, fp))
    return figures, verdicts


def table(results: dict[str, dict]) -> Iterator[str]:
    yield f"{'rules':<7}{'kind':<7}{'replacements':>13}{'files':>7}{'judged FP':>11}{'FP rate':>9}"
    for kind in KINDS:
        if kind == "email":
            yield "e-mail (mostly genuine addresses, counted apart):"
        for label, figures in results.items():
            f = figures[kind]
            rate = f"{f['false_positives'] / f['replacements']:.1%}" if f["replacements"] else "-"
            yield f"{label:<7}{kind:<7}{f['replacements']:>13,}{f['files']:>7,}{f['false_positives']:>11,}{rate:>9}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default=BEFORE, help="git revision whose pii module gives the old rules")
    ap.add_argument("--show", choices=["before", "after"], help="print every replacement with its verdict")
    ap.add_argument("--changelogs", action="store_true", help="add /usr/share/doc/*/changelog* to the files")
    args = ap.parse_args()
    if not PSL.exists():
        sys.exit(f"{PSL} is missing (Debian package publicsuffix); the e-mail judge needs it")

    paths = doc_files(args.changelogs)
    texts = [t for t in (read_text(p) for p in paths) if t is not None]
    print(f"{len(texts)} files ({sum(len(t) for t in texts):,} characters) of {len(paths)} found")
    tlds = public_tlds()
    old = subprocess.run(["git", "-C", str(ROOT), "show", f"{args.before}:{MODULE}"], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    modules = {
        "before": load_module(old, "pii_before"),
        "after": load_module((ROOT / MODULE).read_text(), "pii_after"),
    }
    results, shown = {}, []
    for label, module in modules.items():
        stage, hits = instrumented(module)
        results[label], verdicts = measure(stage, hits, texts, tlds)
        if label == args.show:
            shown = verdicts
    for hit, fp in shown:
        context = (hit.before[-40:] + "[" + hit.span + "]" + hit.after[:20]).replace("\n", " ")
        print(f"{'FP' if fp else 'ok'} {hit.kind:<6}{context}")
    print(f"pii false positives, before = {args.before[:12]}, after = working tree:")
    for row in table(results):
        print(row)
    print(
        json.dumps({"files": len(texts), "changelogs": args.changelogs, "before_rev": args.before, **results})
    )


if __name__ == "__main__":
    main()
