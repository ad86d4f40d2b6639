"""Which pattern matches of the ``pii`` stage are personal data: context and keep-lists.

The patterns in :mod:`lmforge.corpus.stages.pii` find text shaped like an address or a number; the rules
here decide, from the match and the text around it, whether it is replaced. They exist because
technical text is full of look-alikes: version strings (``GCC 2.7.2.3``), ZIP+4 codes (``MA
02110-1301`` in every GPL notice), loopback and example addresses (``127.0.0.1``, ``192.0.2.1``), and
file or unit names with an ``@`` (``ca@valencia.po``, ``getty@tty1.service``).

IP addresses (checked with the standard library's :mod:`ipaddress`):

* always kept: addresses that name no host of anyone: "this network" ``0.0.0.0/8``, loopback
  ``127.0.0.0/8`` and ``::1``, the unspecified ``::``, the documentation ranges ``192.0.2.0/24``,
  ``198.51.100.0/24``, ``203.0.113.0/24`` (RFC 5737) and ``2001:db8::/32`` (RFC 3849), benchmarking
  ``198.18.0.0/15`` (RFC 2544), multicast groups ``224.0.0.0/4`` and ``ff00::/8``, and the reserved
  ``240.0.0.0/4`` with the broadcast ``255.255.255.255``;
* kept unless ``redact_private_ip``: private-use addresses, ``10.0.0.0/8``, ``172.16.0.0/12``,
  ``192.168.0.0/16`` (RFC 1918), the carrier-grade NAT space ``100.64.0.0/10`` (RFC 6598), link-local
  ``169.254.0.0/16`` and ``fe80::/10``, unique-local ``fc00::/7`` (RFC 4193). Each is reused by
  millions of networks and is not reachable from the internet, so outside its own network it singles
  out no one (the reason the GDPR treats public addresses as personal data: an ISP can tie them to a
  subscriber); they fill configuration examples and documentation. BigCode's StarCoder redaction keeps
  them too. A corpus of leaked internal logs, where they map a company's network, can switch them on;
* IPv6 outside ``2000::/3``, the only block IANA allocates for global unicast (RFC 4291), is kept
  apart from the private ranges above: the rest is reserved, so ``2:4:6:8:10:12:14:16`` is a list;
* an IPv4 dotted quad is a version or section number, not an address, when there is any of this
  evidence (the match itself already has octets 0-255 without leading zeros and is not inside a
  longer dotted number):

  - it is glued to a name by ``-`` or ``_`` (``gettext-0.19.8.1``) or carries a version suffix
    (``1.0.24.2-5``, ``1.2.99.1+cvs``, ``1.2.3.4~rc1``; but ``10.0.0.1-10.0.0.9`` is a range of addresses);
  - its line is a heading, underlined by a row of ``-``, ``=``, ``~`` or ``^`` (``3.7.91.1 - 2013-03-05``
    in a NEWS file);
  - a comparison operator is right before it (``zlib >= 1.2.2.3``, ``(<< 1.0.24.2-5)``, with a Debian
    epoch ``(>= 1:1.0.99.4)``), or a change phrase (``fixed in``, ``broken in``, ``added in``, ``new
    in``, ``regression since``, ...);
  - it is the version of a Debian changelog entry header, ``dpkg (1.16.4.3) unstable; urgency=low``
    (Debian Policy 4.4);
  - one of the three words before it on its line is a version or numbering word (``version``, ``v``,
    ``release``, ``build``, ``rev``, ``patch``, ``update``, ``bump``, ``since``, ``standards``,
    ``policy``, ``requires``, ``firmware``, ``kernel``, ``section``, ``clause``, ...; see
    ``NUMBER_WORDS``) and no networking word (``ADDRESS_WORDS``) is nearer;
  - the word right before it is a product name written with a capital letter after its first one
    (``GCC 2.7.2.3``, ``XFree86 4.3.0.1``, ``libX11 1.4.99.1``, ``OpenSSL``), unless that word is
    networking vocabulary (``IP``, ``DNS``, ``TCP``, ...) or a log level (``INFO``, ``WARN``);
  - all four octets are single digits (``1.7.8.6``) and no networking word is on the same line:
    among addresses this shape is a handful of public resolvers (``1.1.1.1``, ``8.8.8.8``,
    ``9.9.9.9``), among version and section numbers it is common (BigCode's filter drops the shape
    unless "dns" or "server" is near).

  Not recognised as versions: a title-case or lower-case name right before the number (``Linux
  2.6.32.1``, ``Git 1.7.12.4``, ``libc 2.7.2.30``, ``at-spi2-core 2.39.90.1``) when no other evidence
  is there; a word like ``Ban`` or ``ping`` before an address reads the same way, so those stay
  redacted. Nor section numbers without a numbering word (``11.3.3.2 of the PNG spec``), nor a version
  after a date (``2009-10-30 (3.6.16.1)``).

Phone numbers: the pattern already asks for phone structure (a ``+``/``00`` country code starting
with 1-9, North American 3-3-4 groups with area code and exchange starting with 2-9 and one kind of
separator, or a trunk ``0`` and an area code starting with 1-9 with grouped digits); a ``0dddd-dddd``
span (five digits, a hyphen, four) is a ZIP+4 code (New England codes start with 0), not a national
number; and a match that is one stretch of a longer run of digit groups with its own separator (a hex
dump ``05 00 00 00 00 00``, a list ``700 800 900 1000 1095``) is not a phone.

E-mail addresses: kept when the domain is reserved for documentation (``example.com``, ``example.net``,
``example.org`` and their subdomains, RFC 2606; the top-level names ``example``, ``test``,
``invalid``, ``localhost``, RFC 6761) or when the last label is a file-type or systemd-unit suffix that is no top-level domain (``en@quot.header``,
``ca@valencia.po``, ``icon@2x.png``, ``getty@tty1.service``; see ``NOT_TLDS``: none is a top-level
domain, except the brand domains ``java`` and ``target``, which serve no mailboxes). Addresses at
private names (``jdoe@Janes-MacBook.local``, ``.lan``, ``.localdomain``) are replaced: they are not
deliverable, but they carry someone's login and often their name.
"""

from __future__ import annotations

import ipaddress
import re

_Network = ipaddress.IPv4Network | ipaddress.IPv6Network

# addresses of no one: this network, loopback, documentation, benchmarking, multicast, reserved/broadcast
KEEP_NETWORKS: tuple[_Network, ...] = tuple(
    ipaddress.ip_network(n)
    for n in (
        "0.0.0.0/8", "127.0.0.0/8", "192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24", "198.18.0.0/15",
        "224.0.0.0/4", "240.0.0.0/4", "::/128", "::1/128", "2001:db8::/32", "ff00::/8",
    )
)  # fmt: skip
# the only IPv6 block IANA allocates for global unicast (RFC 4291); the rest is reserved or special
GLOBAL_UNICAST_V6 = ipaddress.IPv6Network("2000::/3")
# private use: RFC 1918, carrier-grade NAT, link-local (v4 and v6), IPv6 unique-local
PRIVATE_NETWORKS: tuple[_Network, ...] = tuple(
    ipaddress.ip_network(n)
    for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "169.254.0.0/16",
              "fe80::/10", "fc00::/7")
)  # fmt: skip

NUMBER_WORDS = frozenset(
    {
        "version", "versions", "ver", "vers", "v", "release", "released", "releases", "rel", "revision", "rev",
        "build", "patch", "patchlevel", "update", "updated", "upgrade", "upgraded", "bump", "bumped", "since",
        "standards", "policy", "section", "sect", "sec", "clause", "chapter", "appendix", "annex", "paragraph",
        "para", "table", "figure", "fig", "require", "requires", "required", "depends", "kernel", "firmware"
    }
)  # fmt: skip
ADDRESS_WORDS = frozenset(
    {
        "ip", "ipv4", "ipv6", "address", "addresses", "addr", "host", "hosts", "hostname", "server", "servers",
        "dns", "resolver", "nameserver", "gateway", "router", "route", "ping", "inet", "proxy", "peer",
        "client", "subnet", "netmask", "network", "firewall", "connect", "connected", "connecting",
        "connection", "listen", "listening", "bind", "ssh", "dhcp", "nat", "lan", "wan", "vpn", "tcp", "udp",
        "icmp", "http", "https", "ftp", "smtp", "ntp", "url", "uri", "src", "dst", "cgnat", "isp", "dmz", "vps",
        "vm", "nic", "wlan", "wifi"
    }
)  # fmt: skip
_LOG_WORDS = frozenset(
    {"info", "warn", "warning", "error", "err", "debug", "notice", "alert", "crit", "critical", "fatal", "trace"}
)  # fmt: skip

_WORD = re.compile(r"[A-Za-z][A-Za-z0-9_+]*")
_WORD_BEFORE = re.compile(r"([A-Za-z][A-Za-z0-9_+]*)[ \t(]+$")
_GLUED_BEFORE = re.compile(r"[A-Za-z][-_]$")
_OPERATOR_BEFORE = re.compile(r"(?:[<>=!~]=|<<|>>|\w[ \t]*[<>])[ \t(]*(?:\d+:)?$")  # with a Debian epoch
_CHANGE_BEFORE = re.compile(
    r"\b(?:fixed|broken|introduced|added|removed|deprecated|changed|new|regression)[ \t]+(?:in|since)[ \t]+$",
    re.IGNORECASE,
)
# Debian changelog entry header (Debian Policy 4.4): "package (version) distribution(s); urgency=..."
_DEBIAN_HEADER_AFTER = re.compile(r"\)(?:[ \t]+[\w.-]+)+;[ \t]*urgency=")
_SUFFIX_AFTER = re.compile(r"[-~+][A-Za-z0-9]")
_RANGE_AFTER = re.compile(r"-\d{1,3}(?:\.\d{1,3}){3}")
_UNDERLINE = re.compile(r"\n[ \t]*([-=~^*#])\1{2,}[ \t]*(?:\n|$)")
_CONTEXT_CHARS = 64  # how far back on the line the version evidence is looked for

ZIP4 = re.compile(r"0\d{4}-\d{4}")

DOCUMENTATION_DOMAINS = ("example.com", "example.net", "example.org")
RESERVED_TLDS = frozenset({"example", "test", "invalid", "localhost"})
NOT_TLDS = frozenset(
    {
        "po", "pot", "header", "service", "socket", "timer", "target", "mount", "automount", "swap", "slice",
        "scope", "device", "path", "png", "jpg", "jpeg", "gif", "svg", "ico", "bmp", "webp", "tif", "tiff",
        "js", "mjs", "css", "htm", "html", "txt", "json", "xml", "yaml", "yml", "toml", "ini", "cfg", "conf",
        "log", "tmp", "bak", "lock", "gz", "bz2", "xz", "tgz", "tar", "deb", "rpm", "exe", "dll", "dylib",
        "obj", "pdf", "csv", "tsv", "sql", "sqlite", "patch", "diff", "orig", "rej", "cpp", "hpp", "cxx",
        "java", "class", "jar"
    }
)  # fmt: skip


def _in(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, networks: tuple[_Network, ...]) -> bool:
    return any(ip in net for net in networks)


def ip_is_personal(span: str, redact_private: bool) -> bool:
    """Whether the address ``span`` (already valid) may identify someone: in ``PRIVATE_NETWORKS`` only
    if ``redact_private``; otherwise not in ``KEEP_NETWORKS`` and, for IPv6, in the global unicast block
    ``2000::/3``. IPv4-mapped IPv6 is judged by its IPv4."""
    ip = ipaddress.ip_address(span)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if _in(ip, PRIVATE_NETWORKS):
        return redact_private
    if isinstance(ip, ipaddress.IPv6Address) and ip not in GLOBAL_UNICAST_V6:
        return False
    return not _in(ip, KEEP_NETWORKS)


def _line_before(text: str, start: int) -> str:
    lo = max(0, start - _CONTEXT_CHARS)
    return text[text.rfind("\n", lo, start) + 1 or lo : start]


def _line_has_address_word(text: str, start: int, end: int) -> bool:
    lo, hi = text.rfind("\n", 0, start) + 1, text.find("\n", end)
    line = text[lo : hi if hi >= 0 else len(text)]
    return any(w.lower() in ADDRESS_WORDS for w in _WORD.findall(line))


def ipv4_is_version(text: str, start: int, end: int) -> bool:
    """Whether the dotted quad ``text[start:end]`` is a version or section number (rules in the module
    docstring); ``False`` means it is read as an address."""
    after = text[end : end + 80]
    if _SUFFIX_AFTER.match(after) and not _RANGE_AFTER.match(after):
        return True
    eol = text.find("\n", end)
    if eol >= 0 and _UNDERLINE.match(text, eol):  # a heading: "3.7.91.1 - 2013-03-05" over a row of "-"
        return True
    before = _line_before(text, start)
    if _GLUED_BEFORE.search(before) or _OPERATOR_BEFORE.search(before) or _CHANGE_BEFORE.search(before):
        return True
    if before.endswith("(") and _DEBIAN_HEADER_AFTER.match(after):
        return True
    for word in reversed(_WORD.findall(before)[-3:]):
        w = word.lower()
        if w in ADDRESS_WORDS:
            break
        if w in NUMBER_WORDS:
            return True
    m = _WORD_BEFORE.search(before)
    if m:
        word = m.group(1)
        named = any(ch.isupper() for ch in word[1:])
        if named and word.lower() not in ADDRESS_WORDS and word.lower() not in _LOG_WORDS:
            return True
    single_digits = end - start == 7
    return single_digits and not _line_has_address_word(text, start, end)


def phone_is_postcode(span: str) -> bool:
    """A ZIP+4 code (``02110-1301``), which the national-number pattern would otherwise take."""
    return ZIP4.fullmatch(span) is not None


def phone_in_digit_run(text: str, start: int, end: int) -> bool:
    """Whether the match is one stretch of a longer run of digit groups with one of its own separators
    (a hex dump ``05 00 00 00 00 00``, a list of sizes ``700 800 900 1000 1095``): a phone number ends
    where its groups end."""
    span = text[start:end]
    seps = {ch for ch in span if ch in " .-"}
    after, before = text[end : end + 2], text[max(0, start - 2) : start]
    continues = len(after) == 2 and after[0] in seps and after[1].isdigit()
    follows = len(before) == 2 and before[1] in seps and before[0].isdigit()
    return continues or follows


def email_is_personal(span: str) -> bool:
    """Whether ``local@domain`` may be someone's mailbox: not at a documentation or local-use domain,
    and not ending in a file-type or unit suffix (``NOT_TLDS``)."""
    domain = span.rsplit("@", 1)[1].lower()
    tld = domain.rsplit(".", 1)[-1]
    if tld in RESERVED_TLDS or tld in NOT_TLDS:
        return False
    return not any(domain == d or domain.endswith("." + d) for d in DOCUMENTATION_DOMAINS)
