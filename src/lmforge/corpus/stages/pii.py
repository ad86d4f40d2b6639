"""PII redaction: e-mail addresses, IP addresses, phone numbers and payment-card numbers.

Each kind is found by a precompiled regular expression and, where the pattern alone would also catch
ordinary text, confirmed by a check on the match (the Luhn checksum and an issuer prefix for cards,
``ipaddress`` for IPv6, digit counts for phones) and by the context and keep-list rules of
:mod:`lmforge.corpus.stages.pii_rules` (versions are not addresses, loopback and documentation
addresses name no one, a ZIP+4 code is not a phone). Matches are replaced with typed placeholders and
the number of replacements per kind is stored in ``doc.meta["pii"]`` (every kind, zeros included, so
the field has the same shape on every document).

What is recognised (and what is deliberately not):

* e-mail: ``local@domain.tld`` with the usual local-part characters (``. _ % + -``); not at the
  documentation domains (``example.com``, ``.test``, ``.invalid``, ...) and not
  when the "top-level domain" is a file or unit suffix (``ca@valencia.po``, ``getty@tty1.service``);
* IPv4: four dotted octets 0-255 without leading zeros, not part of a longer dotted number and not a
  version or section number by its context (``GCC 2.7.2.3``, ``version 1.2.3.4``, ``gettext-0.19.8.1``,
  ``1.0.24.2-5``, ``zlib >= 1.2.2.3``; the rules are in ``pii_rules``);
* IPv6: full and ``::``-compressed forms that ``ipaddress`` accepts, with at least three groups written
  out and at least one digit (so C++ ``a::b`` and times like ``12:30:45`` are kept), in the global
  unicast block ``2000::/3`` (or private, below);
* of the addresses, loopback, unspecified, documentation (RFC 5737, RFC 3849), benchmarking,
  multicast, reserved and broadcast ones are never replaced, private-use ones (RFC 1918, CGNAT,
  link-local, unique-local) only with ``redact_private_ip``;
* phones: international numbers starting with ``+`` (or ``00``, then written with separators), a
  country code starting with 1-9 and 8-15 digits in groups; North American numbers ``(555) 234-5678``,
  ``555-234-5678``, ``555.234.5678``, ``555 234 5678`` with an optional leading ``1`` (area code and
  exchange start with 2-9, and both separators are the same, so ``252.227-7013`` is a clause number);
  national numbers with a trunk ``0``, an area code starting with 1-9 and 9-12 digits in groups with
  one separator (``020 7946 0958``, ``01 23 45 67 89``, ``01.23.45.67.89``, ``030 1234567``), but not
  ``0dddd-dddd``, which is a ZIP+4 code (``MA 02110-1301``). Bare digit strings are not phones here (too
  many identifiers look alike), nor is a stretch of a longer run of digit groups (hex dumps);
* cards: 13-19 digits, contiguous or in groups of four (Amex/Diners 4-6-5 and 4-6-4), with a known
  issuer prefix (2, 3, 4, 5, 6) and a valid Luhn checksum, not a part of a URL path.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from dataclasses import replace

from pydantic import Field

from lmforge.corpus.document import Doc, Drop
from lmforge.corpus.stages.base import DocStage, StageParams
from lmforge.corpus.stages.pii_rules import (
    email_is_personal,
    ip_is_personal,
    ipv4_is_version,
    phone_in_digit_run,
    phone_is_postcode,
)

# Speed: each pattern starts with a character class (the regex engine then skips ahead in C to the
# next candidate character) and checks the character before the match with a two-character
# look-behind that includes the first matched character; possessive runs (\d++) never re-split digits.
_EMAIL = re.compile(
    r"[A-Za-z0-9](?<![\w.%+-][A-Za-z0-9])[A-Za-z0-9._%+-]{0,63}@"
    r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+[A-Za-z]{2,24}(?![\w-])"
)
# four dotted runs of 1-3 digits, not inside a longer dotted number; octets <= 255 are checked after
_IPV4 = re.compile(r"\d(?<![\w.]\d)\d{0,2}+(?:\.\d{1,3}+){3}(?!\w|\.\d)")
_IPV6 = re.compile(
    r"(?::(?<![\w:.]:)|[0-9A-Fa-f](?<![\w:.][0-9A-Fa-f])[0-9A-Fa-f]{0,3})"
    r"(?::[0-9A-Fa-f]{0,4}){2,7}(?![\w:]|\.\w)"
)
_PHONE = re.compile(
    r"(?=[+(\d])(?<![\w+./~-])(?:"
    # international: +CC or 00CC (country codes start with 1-9), then groups (one may be a
    # parenthesised trunk or area code)
    r"(?:\+|00)[1-9]\d{0,2}+(?:[ .-]?+(?:\(\d{1,4}+\)|\d++)){1,6}+"
    r"|"
    # North American: optional 1, area code (2-9) in brackets or followed by a separator, exchange
    # (2-9) and 4 digits; without brackets both separators are the same (555-234-5678, not 252.227-7013)
    r"(?:1[ .-]?)?(?:\([2-9]\d\d\)[ ]?[2-9]\d\d[ .-]|[2-9]\d\d(?P<na>[ .-])[2-9]\d\d(?P=na))\d{4}"
    r"|"
    # national with trunk 0: 0 + area code (not starting with 0: "00" is the international prefix), then
    # one to four groups with one and the same separator (so a date followed by a number, "05-06-2023
    # 14", is not one phone), or a bracketed area code
    r"0[1-9]\d{0,3}+(?P<sep>[ .-])\d{2,8}+(?:(?P=sep)\d{2,8}+){0,3}+"
    r"|\(0[1-9]\d{0,3}+\)[ ]?\d{2,8}+(?:[ .-]?\d{2,8}+){0,3}+"
    r")(?![\w/+~-]|\.\d)"
)
_CARD = re.compile(r"\d(?<![\w.+/-]\d)(?:[ -]?\d){12,18}(?![\w-]|\.\d)")  # not a URL path part
_CARD_GROUPS = {(4, 4, 4, 4), (4, 4, 4, 1), (4, 4, 4, 2), (4, 4, 4, 3), (4, 4, 4, 4, 3), (4, 6, 5), (4, 6, 4)}


def luhn_valid(digits: str) -> bool:
    """The Luhn checksum: from the right, double every second digit (subtracting 9 above 9); the sum
    of all digits must be a multiple of 10."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2:
            d *= 2
            if d > 9:
                d -= 9
        total += d
    return total % 10 == 0


def _is_card(span: str) -> bool:
    digits = span.replace(" ", "").replace("-", "")
    if not 13 <= len(digits) <= 19 or digits[0] not in "23456":
        return False
    if digits != span:
        groups = tuple(len(g) for g in re.split(r"[ -]", span))
        if groups not in _CARD_GROUPS:
            return False
    return luhn_valid(digits)


def _is_ipv6(span: str) -> bool:
    groups = [g for g in span.split(":") if g]
    if len(groups) < 3 or not any(ch.isdigit() for ch in span):
        return False
    try:
        ipaddress.IPv6Address(span)
    except ValueError:
        return False
    return True


def _is_ipv4(span: str) -> bool:
    return all(len(octet) == 1 or (octet[0] != "0" and int(octet) <= 255) for octet in span.split("."))


def _phone_digits_ok(span: str) -> bool:
    n = sum(ch.isdigit() for ch in span)
    if span.startswith("00"):  # written without "+", only with separators: 0096953990 is an identifier
        return 8 <= n <= 16 and any(ch in " .-(" for ch in span)
    if span.startswith("+"):
        return 8 <= n <= 16  # E.164: at most 15, plus a bracketed trunk 0
    if span.startswith(("0", "(0")):
        return 9 <= n <= 12
    return n in (10, 11)  # North American, with or without the leading 1


class PiiParams(StageParams):
    """Which kinds to redact and their placeholders. The patterns and checks are described in the
    module docstring; the placeholders follow the ``<TYPE>`` convention of common redaction tools."""

    email: bool = Field(True, description="Redact e-mail addresses.")
    ip: bool = Field(True, description="Redact IPv4 and IPv6 addresses.")
    phone: bool = Field(True, description="Redact phone numbers.")
    card: bool = Field(True, description="Redact payment-card numbers (Luhn-valid, issuer prefix).")
    redact_private_ip: bool = Field(
        False,
        description="Also redact private-use addresses (10/8, 172.16/12, 192.168/16, 100.64/10, "
        "link-local, fc00::/7); loopback and documentation addresses are never redacted.",
    )
    email_placeholder: str = Field("<EMAIL>", description="Replacement for an e-mail address.")
    ip_placeholder: str = Field("<IP>", description="Replacement for an IP address.")
    phone_placeholder: str = Field("<PHONE>", description="Replacement for a phone number.")
    card_placeholder: str = Field("<CARD>", description="Replacement for a card number.")


class PiiRedact(DocStage):
    """Replaces e-mails, IPs, phones and card numbers with placeholders; counts in ``meta["pii"]``."""

    name = "pii"
    Params = PiiParams

    def redact(self, text: str) -> tuple[str, dict[str, int]]:
        """``text`` with PII replaced, and the number of replacements per kind."""
        p: PiiParams = self.params
        counts = {"email": 0, "ip": 0, "phone": 0, "card": 0}

        def sub(
            pattern: re.Pattern[str], kind: str, placeholder: str, personal: Callable[[re.Match[str]], bool]
        ) -> None:
            """Replace each match of ``pattern`` for which ``personal(match)`` holds; count it."""
            nonlocal text

            def one(m: re.Match[str]) -> str:
                if not personal(m):
                    return m.group()
                counts[kind] += 1
                return placeholder

            text = pattern.sub(one, text)

        if p.email and "@" in text:
            sub(_EMAIL, "email", p.email_placeholder, lambda m: email_is_personal(m.group()))
        if p.ip and ":" in text:
            sub(
                _IPV6,
                "ip",
                p.ip_placeholder,
                lambda m: _is_ipv6(m.group()) and ip_is_personal(m.group(), p.redact_private_ip),
            )
        if p.ip and "." in text:
            sub(
                _IPV4,
                "ip",
                p.ip_placeholder,
                lambda m: (
                    _is_ipv4(m.group())
                    and not ipv4_is_version(m.string, m.start(), m.end())
                    and ip_is_personal(m.group(), p.redact_private_ip)
                ),
            )
        if p.card:
            sub(_CARD, "card", p.card_placeholder, lambda m: _is_card(m.group()))
        if p.phone:
            sub(
                _PHONE,
                "phone",
                p.phone_placeholder,
                lambda m: (
                    _phone_digits_ok(m.group())
                    and not phone_is_postcode(m.group())
                    and not phone_in_digit_run(m.string, m.start(), m.end())
                ),
            )
        return text, counts

    def process(self, doc: Doc) -> Doc | Drop:
        text, counts = self.redact(doc.text)
        meta = {**doc.meta, "pii": counts}
        return replace(doc, text=text, meta=meta)
